"""``Engine.when_over(transfer, fn)``: ``fn(state)`` exactly once when the transfer is no
longer pending. tcp calls it from the read's own completion (real sockets, a real
``PeerServer``); engines without a completion (the base default, nixl) from one watcher
thread, which sleeps on its condition while nothing is watched and ends on ``close``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorhub_cli.endpoint.peer import PeerServer
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import Engine, EngineError, Pair, Region
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.engines.tcp import TcpEngine

from .nixlkit import nixl_pair

TOKEN = "t"


class Calls:
    """A completion callback that records (state, thread name) and signals each call."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.called = threading.Event()

    def __call__(self, state: str) -> None:
        self.calls.append((state, threading.current_thread().name))
        self.called.set()

    def wait(self, timeout: float = 10.0) -> list[tuple[str, str]]:
        assert self.called.wait(timeout), "the completion callback never came"
        return self.calls


@pytest.fixture
def served():
    src = torch.ones(4 << 20, dtype=torch.uint8)
    regions = Regions()
    regions.add(1, [Region(src.data_ptr(), src.nbytes)], owner=src)
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), regions, idle_s=60)
    engine = TcpEngine(TOKEN, timeout=5.0)
    yield server, engine, src
    engine.close(timeout=5)
    server.close(timeout=5)


def test_tcp_calls_back_once_when_a_read_is_done_from_its_own_thread(served):
    server, engine, src = served
    dst = torch.zeros_like(src)
    xfer = engine.read(server.address, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
    calls = Calls()
    engine.when_over(xfer, calls)
    assert calls.wait() == [("done", calls.calls[0][1])] and calls.calls[0][1].startswith("th-tcp")
    assert torch.equal(dst, src)
    late = Calls()
    engine.when_over(xfer, late)  # already over: at once, on this thread
    assert late.calls == [("done", threading.current_thread().name)]
    time.sleep(0.1)
    assert len(calls.calls) == 1 and engine.release(xfer)


def test_tcp_calls_back_once_with_failed_when_the_holder_goes_away_mid_read(served, monkeypatch):
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))  # 4 MiB at 1 MiB/s: still sending when we stop it
    server, engine, src = served
    dst = torch.zeros_like(src)
    xfer = engine.read(server.address, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
    calls = Calls()
    engine.when_over(xfer, calls)
    deadline = time.monotonic() + 10
    while not dst.count_nonzero() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not calls.calls, "called back while the read was still receiving"
    server.close(timeout=5)  # the holder is gone: its connections are cut
    assert [s for s, _ in calls.wait()] == ["failed"]
    time.sleep(0.1)
    assert len(calls.calls) == 1 and engine.release(xfer)


class FlipEngine(Engine):
    """An engine without a completion of its own: the base's watcher checks ``state``."""

    kind = "flip"

    def __init__(self):
        self.states: dict[int, str] = {}

    def register(self, regions):
        return object()

    def describe(self, handle):
        return b""

    def deregister(self, handle):
        pass

    def add_peer(self, address, description):
        return address

    def read(self, peer, pairs, device=-1, remote_device=None):
        xfer = len(self.states)
        self.states[xfer] = "pending"
        return xfer

    def state(self, transfer):
        return self.states[transfer]

    def release(self, transfer):
        return self.states[transfer] != "pending"


def wait_idle(engine: Engine, timeout: float = 10.0):
    watcher = engine._watch
    deadline = time.monotonic() + timeout
    while watcher._thread is not None and not watcher.idle:  # (no thread yet: nothing runs)
        assert time.monotonic() < deadline, "the watcher never went back to sleep"
        time.sleep(0.005)
    return watcher


def test_the_watcher_calls_back_once_when_a_state_flips():
    engine = FlipEngine()
    try:
        done, failed = engine.read("p", []), engine.read("p", [])
        on_done, on_failed = Calls(), Calls()
        engine.when_over(done, on_done)
        engine.when_over(failed, on_failed)
        time.sleep(0.05)
        assert not on_done.calls and not on_failed.calls, "called back while pending"
        engine.states[done] = "done"
        assert on_done.wait() == [("done", "th-watch-flip")]
        engine.states[failed] = "failed"
        assert on_failed.wait() == [("failed", "th-watch-flip")]
        wait_idle(engine)
        assert len(on_done.calls) == len(on_failed.calls) == 1
        now = Calls()
        engine.when_over(done, now)  # already over: at once, on this thread
        assert now.calls == [("done", threading.current_thread().name)]
    finally:
        engine.close()


def test_the_watcher_sleeps_on_its_condition_while_nothing_is_watched_and_ends_on_close():
    engine = FlipEngine()
    xfer = engine.read("p", [])
    calls = Calls()
    engine.when_over(xfer, calls)
    engine.states[xfer] = "done"
    calls.wait()
    watcher = wait_idle(engine)
    rounds = watcher.rounds
    time.sleep(0.2)  # (a thread that kept checking would count rounds here, every ~1 ms)
    assert watcher.idle and watcher.rounds == rounds, "the idle watcher kept checking"
    thread = watcher._thread
    assert thread.is_alive()
    engine.close()
    assert not thread.is_alive(), "the watcher thread outlived close"
    with pytest.raises(EngineError, match="closed"):
        engine.when_over(engine.read("p", []), Calls())


def test_close_calls_back_what_ended_and_drops_what_is_still_pending():
    engine = FlipEngine()
    ended, stuck = engine.read("p", []), engine.read("p", [])
    on_ended, on_stuck = Calls(), Calls()
    engine.when_over(ended, on_ended)
    engine.when_over(stuck, on_stuck)
    watcher = engine._watch
    with watcher._cond:  # (the thread cannot start a round before close is set)
        engine.states[ended] = "failed"
        watcher._closed = True
        watcher._cond.notify()
    watcher._thread.join(10)
    assert on_ended.calls and on_ended.calls[0][0] == "failed"
    assert not on_stuck.calls and watcher.dropped == 1


def test_a_callback_that_raises_is_logged_and_the_watcher_goes_on(caplog):
    engine = FlipEngine()
    try:
        bad, good = engine.read("p", []), engine.read("p", [])
        engine.when_over(bad, lambda state: 1 / 0)
        calls = Calls()
        engine.when_over(good, calls)
        engine.states[bad] = "done"
        time.sleep(0.05)
        engine.states[good] = "done"
        assert calls.wait() == [("done", "th-watch-flip")]
        assert "completion callback raised" in caplog.text
    finally:
        engine.close()


class Checked:
    """A watcher's ``check`` over ``states`` that records (when, transfer) per check."""

    def __init__(self):
        self.states: dict[int, str] = {}
        self.at: list[tuple[float, int]] = []

    def __call__(self, transfers):
        self.at.extend((time.monotonic(), t) for t in transfers)
        return [self.states[t] for t in transfers]


def teach_10_mb_per_s(watcher, checked: Checked) -> None:
    """Transfer 0: 1 MB over 0.1 s, so the watcher predicts the next at 10 MB/s."""
    checked.states[0] = "pending"
    first = Calls()
    watcher.watch(0, first, nbytes=1_000_000)
    time.sleep(0.1)
    checked.states[0] = "done"
    first.wait()


def test_the_watcher_learns_the_rate_and_checks_a_transfer_only_near_its_predicted_end():
    """Once a sized transfer ended, the next one's end is predicted from its bytes: no
    check until most of that time passed (the back-off alone, capped at 4 ms, would
    check it dozens of times), and its end is still noticed promptly."""
    from tensorhub_cli.engines.watcher import Watcher

    check = Checked()
    states, checked = check.states, check.at
    watcher = Watcher(check, max_s=4e-3)
    try:
        teach_10_mb_per_s(watcher, check)
        states[1] = "pending"
        second = Calls()
        t0 = time.monotonic()
        watcher.watch(1, second, nbytes=3_000_000)  # 0.3 s at that rate
        time.sleep(0.2)
        early = [at for at, t in checked if t == 1 and t0 + 0.02 < at < t0 + 0.2]
        assert not early, f"{len(early)} checks long before its predicted end"
        time.sleep(0.15)
        flipped = time.monotonic()
        states[1] = "done"
        second.wait()
        noticed = max(at for at, t in checked if t == 1)
        assert noticed - flipped < 0.05, f"noticed {noticed - flipped:.3f}s after it ended"
    finally:
        watcher.close()


def serving_watcher():
    """A watcher whose engine must be progressed (its ``serve`` counted), checks 4 ms apart at most."""
    from tensorhub_cli.engines.watcher import Watcher

    check, serve = Checked(), Served()
    return Watcher(check, max_s=4e-3, serve=serve), check, serve


def test_where_the_engine_must_be_progressed_a_read_is_checked_every_max_s_far_from_its_predicted_end():
    """Over UCX's TCP transport our READ moves only while our own worker is progressed,
    and a check progresses it: left until its predicted end, the socket stayed full and
    the holder stalled (``engines.watcher``, "Our own reads"). The contrast is the test
    above, whose engine needs no progress: no check long before the predicted end."""
    watcher, check, serve = serving_watcher()
    states, checked = check.states, check.at
    try:
        teach_10_mb_per_s(watcher, check)
        states[1] = "pending"
        second = Calls()
        t0 = time.monotonic()
        watcher.watch(1, second, nbytes=3_000_000)  # predicted 0.3 s
        time.sleep(0.2)
        early = sorted(at for at, t in checked if t == 1 and t0 + 0.02 < at < t0 + 0.2)
        gaps = [b - a for a, b in zip(early, early[1:])]
        assert len(early) >= 20 and max(gaps) < 0.05, \
            f"{len(early)} checks in the 0.18 s before the predicted end, longest gap {max(gaps, default=1):.3f} s"
        assert serve.at == [], "unpaced, it checks our reads; it serves nobody"
        states[1] = "done"
        second.wait()
    finally:
        watcher.close()


def test_a_late_notice_does_not_teach_the_watcher_to_sleep_longer():
    """Regression (a testbed fetch slowed to a crawl): after one slow transfer, faster
    ones were each noticed at the slow one's predicted end and counted as that slow,
    so the watcher never learned otherwise. A transfer's time now ends at the last
    check that found it pending: the second is noticed late, the third on time."""
    from tensorhub_cli.engines.watcher import Watcher

    states: dict[int, str] = {}
    watcher = Watcher(lambda ts: [states[t] for t in ts], max_s=4e-3)
    try:
        late = []
        for i, took in enumerate([0.4, 0.01, 0.01, 0.01]):
            states[i] = "pending"
            calls = Calls()
            watcher.watch(i, calls, nbytes=1_000_000)
            time.sleep(took)
            ended = time.monotonic()
            states[i] = "done"
            calls.wait()
            late.append(time.monotonic() - ended)
        assert max(late[2:]) < 0.1, f"noticed {late} s after each ended"
    finally:
        watcher.close()


class Served:
    """A ``serve`` (an engine's ``progress``) that counts its calls."""

    def __init__(self):
        self.at: list[float] = []

    def __call__(self) -> None:
        self.at.append(time.monotonic())


def test_a_paced_watcher_serves_on_its_own_with_nothing_watched_and_sleeps_once_unpaced():
    from tensorhub_cli.engines.watcher import Watcher

    serve = Served()
    watcher = Watcher(lambda ts: ["pending"] * len(ts), serve=serve)
    try:
        watcher.pace(0.005)
        time.sleep(0.2)
        assert 10 <= len(serve.at) <= 60, f"{len(serve.at)} serves in 0.2 s at a 5 ms pace"
        assert not watcher.idle and watcher.rounds == 0  # (serving is not checking: nothing is watched)
        watcher.pace(None)
        deadline = time.monotonic() + 5
        while not watcher.idle:
            assert time.monotonic() < deadline, "the unpaced watcher never went to sleep"
            time.sleep(0.005)
        served = len(serve.at)
        time.sleep(0.1)
        assert watcher.idle and len(serve.at) == served, "the unpaced watcher kept serving"
    finally:
        watcher.close()


def test_while_paced_a_read_near_its_predicted_end_is_checked_as_finely_and_serving_goes_on():
    """Pacing adds serving wakes (a round then checks our reads too) but never coarsens
    the checks near a read's predicted end (``expect / FINE`` apart): put off to the
    pace, or to ``max_s``, a fast read's end would be noticed that late."""
    watcher, check, serve = serving_watcher()
    states, checked = check.states, check.at
    try:
        teach_10_mb_per_s(watcher, check)
        watcher.pace(0.05)
        states[1] = "pending"
        second = Calls()
        t0 = time.monotonic()
        watcher.watch(1, second, nbytes=1_000_000)  # expected 0.1 s: checks 1.6 ms apart from 85 ms on
        time.sleep(0.2)
        states[1] = "done"
        second.wait()
        near = [at for at, t in checked if t == 1 and t0 + 0.09 < at < t0 + 0.2]
        gaps = [b - a for a, b in zip(near, near[1:])]
        typical = sorted(gaps)[len(gaps) // 2] if gaps else 1.0
        assert typical < 3e-3, f"checks near the predicted end {typical * 1e3:.1f} ms apart (median)"
        served = [at for at in serve.at if t0 < at < t0 + 0.2]
        assert 3 <= len(served) <= 8, f"{len(served)} serves in 0.2 s at a 50 ms pace"
    finally:
        watcher.close()


def test_a_pace_set_while_the_watcher_decides_how_long_to_sleep_is_not_slept_through():
    """The watcher computes its sleep outside its lock; a pace set in that window (a
    peer's ask) notifies nobody. Asleep on the old plan, a long read's predicted wait,
    the holder would serve nobody for seconds."""
    from tensorhub_cli.engines.watcher import Watcher

    check = Checked()
    serve = Served()
    watcher = Watcher(check, max_s=4e-3, serve=serve)
    try:
        teach_10_mb_per_s(watcher, check)
        plan = watcher._next
        asked = []

        def next_then_an_ask(*args):
            out = plan(*args)
            if not asked:  # (the first sleep planned for the long read)
                asked.append(time.monotonic())
                watcher.pace(0.005)
            return out

        watcher._next = next_then_an_ask
        check.states[1] = "pending"
        watcher.watch(1, Calls(), nbytes=100_000_000)  # expected 10 s: first check after 8.5
        deadline = time.monotonic() + 5
        while not serve.at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked and serve.at, "no serving within 5 s of a pace set while the watcher planned its sleep"
        assert serve.at[0] - asked[0] < 1.0
    finally:
        watcher.close()


def test_pace_is_refused_without_serve_and_does_nothing_after_close(caplog):
    from tensorhub_cli.engines.watcher import Watcher

    with pytest.raises(EngineError, match="nothing to serve"):
        Watcher(lambda ts: [], name="th-watch-x").pace(0.001)
    broken = Watcher(lambda ts: [], serve=lambda: 1 / 0)
    broken.pace(0.005)
    time.sleep(0.05)
    assert broken.served >= 2 and broken.serve_failures == broken.served  # (it goes on)
    assert caplog.text.count("progressing the engine for its peers failed") == 1
    broken.close()
    closed = Watcher(lambda ts: [], serve=Served())
    closed.close()
    closed.pace(0.001)
    assert closed._thread is None, "pace after close started a thread"
    engine = FlipEngine()  # (needs no progress: pace is nothing to it)
    engine.pace(0.001)
    assert "_watch" not in engine.__dict__
    engine.close()
    engine.needs_progress = True
    engine.pace(0.001)  # (closed: the watcher made closed by close, no thread)
    assert engine._watch._thread is None


def test_a_paced_nixl_holder_serves_a_real_read_with_nobody_calling_progress(monkeypatch):
    """Over UCX's TCP or shared-memory transport a holder's worker must be progressed
    (test_nixl_progress: without it the READ stays pending); where NIXL's progress thread
    does not (by default; set to 0 here, whatever the caller's environment says)
    ``pace`` has the holder's own watcher do it."""
    monkeypatch.setenv("TH_NIXL_PROGRESS_THREAD", "0")
    with nixl_pair() as (holder, reader, peer, src, dst):
        assert holder.needs_progress
        holder.pace(1e-3)
        xfer = reader.read(peer, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
        calls = Calls()
        reader.when_over(xfer, calls)
        assert [s for s, _ in calls.wait(20)] == ["done"]
        assert reader.release(xfer) and torch.equal(dst, src)
        assert holder._watch.served > 0


def test_the_nixl_watcher_calls_back_a_real_read_on_host_memory():
    """The fake agent (test_nixl_engine) checks the bookkeeping; this, the real NIXL. The
    holder's ``progress`` stands for its endpoint's service thread (where NIXL's progress
    thread runs, the read may be over before ``when_over``: called back at once, and no
    watcher thread starts)."""
    with nixl_pair() as (holder, reader, peer, src, dst):
        xfer = reader.read(peer, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
        calls = Calls()
        reader.when_over(xfer, calls)
        deadline = time.monotonic() + 20
        while not calls.called.is_set() and time.monotonic() < deadline:
            holder.progress()
            time.sleep(0.001)
        assert [s for s, _ in calls.wait(1)] == ["done"]
        assert reader.release(xfer) and torch.equal(dst, src)
        watcher = wait_idle(reader)
    assert watcher._thread is None or not watcher._thread.is_alive()
