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


def test_the_watcher_learns_the_rate_and_checks_a_transfer_only_near_its_predicted_end():
    """Once a sized transfer ended, the next one's end is predicted from its bytes: no
    check until most of that time passed (the back-off alone, capped at 4 ms, would
    check it dozens of times), and its end is still noticed promptly."""
    from tensorhub_cli.engines.watcher import Watcher

    states: dict[int, str] = {}
    checked: list[tuple[float, int]] = []

    def check(transfers):
        checked.extend((time.monotonic(), t) for t in transfers)
        return [states[t] for t in transfers]

    watcher = Watcher(check, max_s=4e-3)
    try:
        states[0] = "pending"
        first = Calls()
        watcher.watch(0, first, nbytes=1_000_000)
        time.sleep(0.1)  # 1 MB in 0.1 s: 10 MB/s
        states[0] = "done"
        first.wait()
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
