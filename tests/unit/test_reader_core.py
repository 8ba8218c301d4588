"""The reader's core (endpoint/reader.py): one chunk table, events in, actions out.

Example tests pin each transition; a hypothesis state machine drives random events
(answers that move chunks, notices, landings, checksums, give-ups) and checks that a
chunk is never read twice at once, never read while a given-up read may still write
it, never counted before it verified, and that every failure is reported."""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tensorhub_cli.endpoint import reader as core


def kinds(actions):
    return [type(a).__name__ for a in actions]


def test_first_step_asks_and_an_answer_starts_ready_chunks_within_the_window():
    r = core.Reader(0b1111, window=2, per_source=2)
    assert kinds(r.step(0.0)) == ["Ask"]
    out = r.step(0.0, [core.Answer([(0, "a", True, False), (1, "a", True, False), (2, "a", True, False),
                                    (3, "b", False, False)])])
    assert [(a.chunk, a.source) for a in out if isinstance(a, core.Start)] == [(0, "a"), (1, "a")]
    assert [(a.source, a.chunks) for a in out if isinstance(a, core.Await)] == [("b", 0b1000)]


def test_a_waiting_chunk_starts_on_its_sources_notice_not_before():
    r = core.Reader(0b1)
    r.step(0.0)
    out = r.step(0.0, [core.Answer([(0, "p", False, False)])])
    assert kinds(out) == ["Await"]
    assert r.step(1.0) == []  # nothing happens without an event: no polling
    out = r.step(1.5, [core.Noticed("p", 0b1)])
    assert [(a.chunk, a.source) for a in out if isinstance(a, core.Start)] == [(0, "p")]


def test_a_verified_chunk_counts_only_after_its_checksum_and_the_last_one_reports():
    r = core.Reader(0b1)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", True, False)])])
    out = r.step(0.1, [core.Landed(0, True)])
    assert kinds(out) == ["Verify"] and r.state[0] == core.VERIFYING
    out = r.step(0.2, [core.Checked(0, True)])
    assert r.state[0] == core.HELD
    ask = [a for a in out if isinstance(a, core.Ask)]
    assert ask and ask[0].done == [0]
    assert kinds(r.step(0.3, [core.Answer([], complete=True)])) == ["Done"]


def test_a_corrupt_chunk_is_reported_failed_at_once_and_read_again_from_the_new_source():
    r = core.Reader(0b11, report_every=100)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", True, False), (1, "p", True, False)])])
    r.step(0.1, [core.Landed(0, True)])
    out = r.step(0.2, [core.Checked(0, False)])
    ask = [a for a in out if isinstance(a, core.Ask)]
    assert ask and ask[0].failed == [(0, "p")]  # failures go out at once, not with the batch
    out = r.step(0.3, [core.Answer([(0, "q", True, False), (1, "p", True, False)])])
    assert [(a.chunk, a.source) for a in out if isinstance(a, core.Start)] == [(0, "q")]


def test_a_timed_out_read_is_stopped_and_only_reported_once_the_engine_confirms():
    r = core.Reader(0b1, read_timeout=1.0)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", True, False)])])
    assert r.wake_at == 1.0  # the driver sleeps until the timeout, not in a loop
    out = r.step(1.5)
    assert kinds(out) == ["Stop"] and r.state[0] == core.STOPPING
    assert r.step(1.6, [core.Answer([(0, "q", True, False)])]) == []  # not read again while it may write
    out = r.step(2.0, [core.Stopped(0)])
    ask = [a for a in out if isinstance(a, core.Ask)]
    assert ask and ask[0].failed == [(0, "p")]


def test_a_dead_parent_fails_its_waits_so_the_hub_reparents_them():
    r = core.Reader(0b11)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", False, False), (1, "p", False, False)])])
    out = r.step(0.5, [core.AwaitFailed("p")])
    ask = [a for a in out if isinstance(a, core.Ask)]
    assert ask and sorted(ask[0].failed) == [(0, "p"), (1, "p")]


def test_the_hubs_stale_not_ready_never_undoes_a_notice():
    r = core.Reader(0b11, window=1, per_source=1)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", False, False), (1, "p", False, False)])])
    r.step(0.1, [core.Noticed("p", 0b11)])
    r.step(0.2, [core.Answer([(0, "p", False, False), (1, "p", False, False)])])  # the hub hears in batches
    assert r.state[1] == core.READY


def test_one_read_at_a_time_per_relay_so_a_relayed_chunk_lands_whole_soonest():
    r = core.Reader(0b1111, window=4, per_source=1)
    r.step(0.0)
    # p and q relay (scheduled before they held these chunks); they noticed us of all four
    r.step(0.0, [core.Answer([(c, "p" if c < 2 else "q", False, False) for c in range(4)])])
    out = r.step(0.1, [core.Noticed("p", 0b11), core.Noticed("q", 0b1100)])
    assert sorted((a.source, a.chunk) for a in out if isinstance(a, core.Start)) == [("p", 0), ("q", 2)]


def test_a_holder_that_had_the_chunks_when_scheduled_takes_the_whole_window():
    r = core.Reader(0b1111, window=4, per_source=1)
    r.step(0.0)
    out = r.step(0.0, [core.Answer([(c, "pub", True, False) for c in range(4)])])
    assert sorted(a.chunk for a in out if isinstance(a, core.Start)) == [0, 1, 2, 3]


def test_a_chain_head_reads_one_chunk_at_a_time_so_each_lands_for_its_child_a_chunk_time_apart():
    r = core.Reader(0b1111, window=4, per_source=1)
    r.step(0.0)
    out = r.step(0.0, [core.Answer([(c, f"pub{c}", True, False) for c in range(4)], serial=True)])
    assert [a.chunk for a in out if isinstance(a, core.Start)] == [0]
    out = r.step(0.1, [core.Landed(0, True)])
    assert [a.chunk for a in out if isinstance(a, core.Start)] == [1], "the next starts once one lands"


class ReaderMachine(RuleBasedStateMachine):
    """Random events against the core; the truth is which transfers really run."""

    def __init__(self):
        super().__init__()
        self.r = core.Reader((1 << 6) - 1, window=3, per_source=2, read_timeout=5.0, wait_timeout=50.0)
        self.now = 0.0
        self.running: dict[int, str] = {}  # chunk -> source of a transfer that may still write it
        self.verifying: set[int] = set()
        self.reported: set[int] = set()
        self.asked = False
        self.apply(self.r.step(self.now))

    def apply(self, actions):
        for a in actions:
            if isinstance(a, core.Start):
                assert a.chunk not in self.running, f"chunk {a.chunk} read twice at once (or under a stopping read)"
                live = sum(1 for c in self.running if self.r.state[c] == core.READING)
                assert live < (1 if self.r.serial else self.r.window), "a start beyond the window (one when serial)"
                self.running[a.chunk] = a.source
            elif isinstance(a, core.Verify):
                self.verifying.add(a.chunk)
            elif isinstance(a, core.Ask):
                assert not self.asked, "two asks in flight"
                self.asked = True
                assert not set(a.done) & self.reported, "a chunk reported held twice"
                self.reported |= set(a.done)
            elif isinstance(a, core.Failed):
                raise AssertionError(a.message)

    def step(self, *events):
        self.apply(self.r.step(self.now, list(events)))

    @rule(data=st.data())
    def answer(self, data):
        if not self.asked:
            return
        self.asked = False
        chunks = data.draw(st.lists(st.integers(0, 5), unique=True))
        reads = [(c, data.draw(st.sampled_from("pq")), data.draw(st.booleans()), False) for c in chunks]
        self.step(core.Answer(reads, serial=data.draw(st.booleans())))

    @rule(source=st.sampled_from("pq"), mask=st.integers(0, 63))
    def notice(self, source, mask):
        if source in self.r.awaiting:
            self.step(core.Noticed(source, mask))

    @rule(data=st.data(), ok=st.booleans())
    def land(self, data, ok):
        live = [c for c in self.running if self.r.state[c] == core.READING]
        if live:
            c = data.draw(st.sampled_from(sorted(live)))
            del self.running[c]
            self.step(core.Landed(c, ok))

    @rule(data=st.data(), ok=st.booleans())
    def check(self, data, ok):
        if self.verifying:
            c = data.draw(st.sampled_from(sorted(self.verifying)))
            self.verifying.discard(c)
            self.step(core.Checked(c, ok))

    @rule(data=st.data())
    def stopped(self, data):
        stopping = [c for c in self.running if self.r.state[c] == core.STOPPING]
        if stopping:
            c = data.draw(st.sampled_from(sorted(stopping)))
            del self.running[c]
            self.step(core.Stopped(c))

    @rule(dt=st.sampled_from([0.1, 6.0, 60.0]))
    def time_passes(self, dt):
        self.now += dt
        self.step()

    @invariant()
    def held_chunks_were_verified_and_nothing_runs_into_them(self):
        for c, s in self.r.state.items():
            if s in (core.HELD, core.PASSED):
                assert c not in self.running and c not in self.verifying
            if s == core.STOPPING:
                assert c in self.running  # a given-up read counts as live until Stopped
        assert len([c for c in self.running if self.r.state[c] == core.READING]) <= self.r.window


ReaderMachine.TestCase.settings = settings(max_examples=int(os.environ.get("TH_HYPOTHESIS_EXAMPLES", 300)),
                                           stateful_step_count=40, deadline=None,
                                           derandomize=not os.environ.get("TH_HYPOTHESIS_RANDOM"))
TestReaderMachine = ReaderMachine.TestCase
