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


def test_by_default_a_fetch_reports_once_at_its_end_not_while_reads_run():
    n = 20
    r = core.Reader((1 << n) - 1, window=n, per_source=n)
    r.step(0.0)
    r.step(0.0, [core.Answer([(c, "p", True, False) for c in range(n)])])
    for c in range(n - 1):  # all but one verified while the last still reads: no report yet
        r.step(0.1 + c, [core.Landed(c, True)])
        assert not [a for a in r.step(0.2 + c, [core.Checked(c, True)]) if isinstance(a, core.Ask)], c
    r.step(n, [core.Landed(n - 1, True)])
    [ask] = [a for a in r.step(n + 0.1, [core.Checked(n - 1, True)]) if isinstance(a, core.Ask)]
    assert sorted(ask.done) == list(range(n)) and r.asks == 2


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


def test_a_replan_asks_at_once_and_the_answer_stops_the_read_from_the_lost_source_before_its_timeout():
    r = core.Reader(0b11, read_timeout=30.0)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", True, False), (1, "q", False, False)])])
    assert r.step(3.0) == []  # nothing of ours failed: a link that is down says nothing
    assert kinds(r.step(3.0, [core.Replan()])) == ["Ask"]
    out = r.step(3.1, [core.Answer([(0, "t", True, False), (1, "t", True, False)])])  # the hub moved both
    assert [a.chunk for a in out if isinstance(a, core.Stop)] == [0]  # long before 30 s
    assert [(a.chunk, a.source) for a in out if isinstance(a, core.Start)] == [(1, "t")]
    out = r.step(3.2, [core.Stopped(0)])
    assert [a.failed for a in out if isinstance(a, core.Ask)] == [[(0, "p")]]


def test_a_replan_while_an_ask_is_in_flight_asks_again_after_its_answer():
    r = core.Reader(0b1)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "p", False, False)])])
    r.step(1.0, [core.Replan()])  # asked
    assert kinds(r.step(1.0, [core.Replan()])) == []  # (one ask in flight at a time)
    out = r.step(1.1, [core.Answer([(0, "p", False, False)])])  # answered from before the drop
    assert kinds(out) == ["Ask"]


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


# --- fragments: a chunk a child may wait for is read, and relayed, a fragment at a time --------
def fragments_of(out):
    return [(a.chunk, a.at, a.nbytes) for a in out if isinstance(a, core.Start)]


def relays(out):
    return [(a.chunk, a.nbytes) for a in out if isinstance(a, core.Relay)]


def test_a_chain_head_reads_its_chunk_in_fragments_and_relays_each_as_it_lands():
    r = core.Reader(0b11, fragments=4, size=lambda c: 100)
    r.step(0.0)
    out = r.step(0.0, [core.Answer([(0, "pub", True, False), (1, "pub", True, False)], serial=True)])
    assert fragments_of(out) == [(0, 0, 25)]
    for at in (25, 50, 75):
        out = r.step(0.1, [core.Landed(0, True)])
        assert relays(out) == [(0, at)] and fragments_of(out) == [(0, at, 25)], out
    out = r.step(0.2, [core.Landed(0, True)])
    assert kinds(out) == ["Relay", "Verify", "Start"] and relays(out) == [(0, 100)]
    assert r.state[0] == core.VERIFYING and fragments_of(out) == [(1, 0, 25)], "verified whole; the next chunk starts"


def test_a_child_reads_a_relays_fragments_as_it_lands_them_and_verifies_the_whole_chunk():
    r = core.Reader(0b1, fragments=4, size=lambda c: 100)
    r.step(0.0)
    out = r.step(0.0, [core.Answer([(0, "parent", False, False)])])
    assert [(a.source, a.chunks, a.after) for a in out if isinstance(a, core.Await)] == [("parent", 1, {0: 0})]
    out = r.step(0.1, [core.Noticed("parent", 0, {0: 40})])
    assert fragments_of(out) == [(0, 0, 25)]
    # it asks for more while it reads what the parent has, not once it runs out
    assert [(a.source, a.after) for a in out if isinstance(a, core.Await)] == [("parent", {0: 40})]
    out = r.step(0.2, [core.Landed(0, True)])
    assert fragments_of(out) == [(0, 25, 15)], "only what the parent has landed"
    out = r.step(0.3, [core.Landed(0, True)])
    assert fragments_of(out) == [] and 0 in r.frag.stalled and "Await" not in kinds(out), "its ask is out already"
    assert r.step(0.4) == [], "nothing without an event: no polling"
    out = r.step(0.5, [core.Noticed("parent", 0b1)])  # held now: the rest, in fragments
    assert fragments_of(out) == [(0, 40, 10)], "back on the fragments' boundaries"
    assert fragments_of(r.step(0.6, [core.Landed(0, True)])) == [(0, 50, 25)]
    r.step(0.6, [core.Landed(0, True)])
    out = r.step(0.7, [core.Landed(0, True)])
    assert relays(out) == [(0, 100)] and "Verify" in kinds(out)
    assert kinds(r.step(0.8, [core.Checked(0, True)])) == ["Ask"] and r.state[0] == core.HELD


def test_one_await_per_relay_covers_the_chunks_it_has_landed_only_part_of_read_or_not():
    """Regression (traced on the testbed): a chunk that became ready on part of its bytes
    while an Await was out was not in the next one, so its reader heard of the rest
    only with the relay's next chunk, a whole fragment time later."""
    r = core.Reader(0b11, fragments=2, size=lambda c: 100)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "parent", False, False), (1, "parent", False, False)])])
    out = r.step(0.1, [core.Noticed("parent", 0, {0: 50, 1: 50})])  # chunk 1 ready, not started
    assert fragments_of(out) == [(0, 0, 50)]
    assert [(a.chunks, a.after) for a in out if isinstance(a, core.Await)] == [(0b11, {0: 50, 1: 50})]
    out = r.step(0.2, [core.Noticed("parent", 0b1)])  # chunk 0 held: 1 is still only half there
    assert [(a.chunks, a.after) for a in out if isinstance(a, core.Await)] == [(0b10, {1: 50})]


def test_a_failed_fragment_tells_our_children_the_bytes_start_over_and_reports_the_chunk():
    r = core.Reader(0b1, fragments=2, size=lambda c: 100, report_every=100)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "pub", True, False)], serial=True)])
    r.step(0.1, [core.Landed(0, True)])
    out = r.step(0.2, [core.Landed(0, False)])
    assert relays(out) == [(0, 0)]
    assert [a.failed for a in out if isinstance(a, core.Ask)] == [[(0, "pub")]]


def test_a_corrupt_fragmented_chunk_resets_what_we_relayed():
    r = core.Reader(0b1, fragments=2, size=lambda c: 100, report_every=100)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "pub", True, False)], serial=True)])
    r.step(0.1, [core.Landed(0, True)])
    r.step(0.2, [core.Landed(0, True)])
    assert relays(r.step(0.3, [core.Checked(0, False)])) == [(0, 0)]


def test_a_chunk_between_fragments_is_given_up_at_once_nothing_of_ours_runs():
    r = core.Reader(0b1, fragments=2, size=lambda c: 100, wait_timeout=10.0, read_timeout=1.0)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "parent", False, False)])])
    r.step(0.1, [core.Noticed("parent", 0, {0: 50})])
    r.step(0.2, [core.Landed(0, True)])
    assert 0 in r.frag.stalled and r.wake_at == 10.2, "between fragments the wait's timeout, not the read's"
    out = r.step(0.5, [core.Answer([(0, "other", True, False)])])  # the hub moved it
    assert "Stop" not in kinds(out) and r.state[0] == core.WANTED
    assert relays(out) == [(0, 0)]


def test_a_fragment_may_take_its_share_of_the_read_timeout_so_a_slow_source_is_left_as_soon():
    r = core.Reader(0b1, fragments=4, size=lambda c: 100, read_timeout=2.0)
    r.step(0.0)
    r.step(0.0, [core.Answer([(0, "slow", True, False)], serial=True)])
    assert r.wake_at == 0.5
    assert kinds(r.step(0.6)) == ["Stop"] and r.state[0] == core.STOPPING


def test_a_holders_window_and_tiles_and_deltas_stay_whole():
    r = core.Reader(0b111, fragments=4, size=lambda c: 100, whole={2})
    r.step(0.0)
    out = r.step(0.0, [core.Answer([(0, "pub", True, False), (1, "p2", False, True), (2, "p3", False, False)])])
    assert fragments_of(out) == [(0, 0, 0)], "a holder that had it, not serial: one read"
    out = r.step(0.1, [core.Noticed("p2", 0b10), core.Noticed("p3", 0b100)])
    assert sorted(fragments_of(out)) == [(1, 0, 0), (2, 0, 0)], "tiles and a delta's chunk are read whole"


class ReaderMachine(RuleBasedStateMachine):
    """Random events against the core; the truth is which transfers really run."""

    def __init__(self):
        super().__init__()
        self.r = core.Reader((1 << 6) - 1, window=3, per_source=2, read_timeout=5.0, wait_timeout=50.0,
                             fragments=3, size=lambda c: 90)
        self.now = 0.0
        self.running: dict[int, str] = {}  # chunk -> source of a transfer that may still write it
        self.got: dict[int, int] = {}  # chunk -> bytes landed in order (fragmented reads)
        self.told: dict[int, int] = {}  # chunk -> bytes last relayed
        self.verifying: set[int] = set()
        self.reported: set[int] = set()
        self.asked = False
        self.apply(self.r.step(self.now))

    def apply(self, actions):
        for a in actions:
            if isinstance(a, core.Start):
                assert a.chunk not in self.running, f"chunk {a.chunk} read twice at once (or under a stopping read)"
                live = sum(1 for c in self.running if self.r.state[c] == core.READING)
                if not a.at:  # (a chunk's next fragment takes no new slot: it is the same chunk's read)
                    assert live < (1 if self.r.serial else self.r.window), "a start beyond the window (one when serial)"
                self.running[a.chunk] = a.source
                if a.nbytes:
                    assert a.at == self.got.get(a.chunk, 0), "fragments out of order, or a gap"
                    self.got[a.chunk] = a.at + a.nbytes
                else:
                    self.got.pop(a.chunk, None)
            elif isinstance(a, core.Relay):
                assert a.nbytes == 0 or a.nbytes > self.told.get(a.chunk, 0), "relayed bytes went backwards"
                assert a.nbytes == 0 or a.nbytes == self.got.get(a.chunk), "relayed bytes not landed here"
                self.told[a.chunk] = a.nbytes
                if not a.nbytes:
                    self.got.pop(a.chunk, None)
            elif isinstance(a, core.Verify):
                assert self.got.get(a.chunk, 90) == 90, "verified before every fragment landed"
                self.got.pop(a.chunk, None)
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
        for c in [c for c in self.got if self.r.state[c] != core.READING]:
            del self.got[c]  # (a read given up starts again from its first byte)

    @rule(data=st.data())
    def answer(self, data):
        if not self.asked:
            return
        self.asked = False
        chunks = data.draw(st.lists(st.integers(0, 5), unique=True))
        reads = [(c, data.draw(st.sampled_from("pq")), data.draw(st.booleans()), False) for c in chunks]
        self.step(core.Answer(reads, serial=data.draw(st.booleans())))

    @rule(source=st.sampled_from("pq"), mask=st.integers(0, 63),
          landed=st.dictionaries(st.integers(0, 5), st.integers(1, 89), max_size=3))
    def notice(self, source, mask, landed):
        if source in self.r.awaiting:
            self.step(core.Noticed(source, mask, {c: n for c, n in landed.items() if not mask >> c & 1}))

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

    @rule()
    def replan(self):
        self.step(core.Replan())

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
            if s == core.HELD:
                assert self.told.get(c, 0) in (0, 90), "held with a partial relay told"
        for c in self.r.frag.stalled:
            assert c not in self.running and self.r.state[c] == core.READING, "stalled yet a fragment runs"
        assert len([c for c in self.running if self.r.state[c] == core.READING]) <= self.r.window
        assert not self.r.replan or self.r.asked, "a replan neither asked nor waiting for the ask in flight"


ReaderMachine.TestCase.settings = settings(max_examples=int(os.environ.get("TH_HYPOTHESIS_EXAMPLES", 300)),
                                           stateful_step_count=40, deadline=None,
                                           derandomize=not os.environ.get("TH_HYPOTHESIS_RANDOM"))
TestReaderMachine = ReaderMachine.TestCase
