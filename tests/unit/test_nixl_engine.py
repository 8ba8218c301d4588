"""The NIXL engine's bookkeeping with a fake agent (no UCX) that behaves as UCX does
when a READ in progress is released: the handle is freed without error, and the GET
goes on (NIXL issue #1958). A transfer is over only once NIXL reports it final; a
pending one is stopped by disconnecting its holder, which NIXL reports as ``ERR``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tensorhub_cli.engines import nixl as nixl_engine
from tensorhub_cli.engines.base import Pair


class FakeAgent:
    def __init__(self):
        self.states: dict[int, str] = {}  # handle -> "PROC" | "DONE" | "ERR"
        self.agents: dict[int, str] = {}  # handle -> the remote agent it reads
        self.posted: set = set()  # handles not freed yet
        self.disconnected: list[str] = []
        self.disconnect_stops = True  # False: a disconnect that leaves the READ pending
        self.n = 0

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, agent):
        self.n += 1
        self.agents[self.n] = agent
        return self.n

    def transfer(self, handle):
        self.posted.add(handle)
        self.states[handle] = "PROC"
        return "PROC"

    def check_xfer_state(self, handle):
        return self.states[handle]

    def release_xfer_handle(self, handle):
        self.posted.discard(handle)  # (UCX: no error, and a GET in progress is not stopped)

    def remove_remote_agent(self, agent):
        self.disconnected.append(agent)
        if self.disconnect_stops:  # (UCX closes the endpoint: every request on it is cancelled)
            for h, a in self.agents.items():
                if a == agent and self.states.get(h) == "PROC":
                    self.states[h] = "ERR"


@pytest.fixture
def engine(monkeypatch):
    agent = FakeAgent()
    fake = SimpleNamespace(nixl_agent=lambda name, config: agent, nixl_agent_config=lambda **kw: None)
    monkeypatch.setattr(nixl_engine, "load_nixl", lambda: fake)
    monkeypatch.setenv("TH_NIXL_PROGRESS_THREAD", "0")  # (a fake agent: no binding to give a thread delay)
    eng = nixl_engine.NixlEngine("t")
    xfer = eng.read(nixl_engine.NixlPeer("holder", "DRAM", 0), [Pair(0x1000, 0x2000, 64)])
    return eng, agent, xfer


def test_a_read_in_progress_is_stopped_by_disconnecting_its_holder_before_it_counts_as_over(engine):
    eng, agent, xfer = engine
    assert eng.release(xfer) is True
    assert agent.disconnected == ["holder"], "a pending READ was released without stopping it"
    assert agent.states[xfer] == "ERR" and xfer not in agent.posted


def test_a_read_nixl_still_reports_pending_is_never_counted_over(engine):
    eng, agent, xfer = engine
    agent.disconnect_stops = False
    assert eng.release(xfer) is False, "a pending READ was counted over: it may still write our memory"
    assert xfer in agent.posted, "the handle of a READ still in progress was freed"
    agent.states[xfer] = "DONE"  # (the holder came back and the GET completed)
    assert eng.release(xfer) is True and xfer not in agent.posted


@pytest.mark.parametrize("final", ["DONE", "ERR"])
def test_a_finished_read_is_released_without_a_disconnect(engine, final):
    eng, agent, xfer = engine
    agent.states[xfer] = final
    assert eng.release(xfer) is True and xfer not in agent.posted and agent.disconnected == []


def test_close_waits_for_posted_transfers_to_end_before_dropping_the_agent(engine):
    eng, agent, xfer = engine
    agent.disconnect_stops = False
    threading.Timer(0.1, agent.states.__setitem__, (xfer, "DONE")).start()
    eng.close(timeout=5)
    assert not agent.posted and eng._agent is None


def test_close_gives_up_after_its_timeout_and_keeps_the_agent(engine):
    eng, agent, xfer = engine
    agent.disconnect_stops = False
    start = time.monotonic()
    eng.close(timeout=0.2)
    assert time.monotonic() - start < 2
    assert agent.posted and eng._agent is agent  # leaked, not freed under UCX


class Over:
    def __init__(self):
        self.states: list[str] = []
        self.called = threading.Event()

    def __call__(self, state):
        self.states.append(state)
        self.called.set()


@pytest.mark.parametrize("final, state", [("DONE", "done"), ("ERR", "failed")])
def test_when_over_calls_back_once_when_nixl_reports_the_read_final(engine, final, state):
    eng, agent, xfer = engine
    over = Over()
    eng.when_over(xfer, over)
    time.sleep(0.05)
    assert over.states == [], "called back while NIXL still reports PROC"
    agent.states[xfer] = final
    assert over.called.wait(10), "no callback after the READ ended"
    time.sleep(0.05)
    assert over.states == [state]
    assert eng.release(xfer) is True
    eng.close(timeout=1)


def test_a_read_released_before_its_callback_is_over_and_its_freed_handle_never_checked(engine):
    eng, agent, xfer = engine
    checked_after_free = []
    real_check = agent.check_xfer_state
    agent.check_xfer_state = lambda h: (checked_after_free.append(h) if h not in agent.posted else None,
                                        real_check(h))[1]
    over = Over()
    eng.when_over(xfer, over)
    assert eng.release(xfer) is True  # given up: disconnected, ERR, freed
    assert over.called.wait(10) and over.states == ["failed"]
    assert checked_after_free == [], "the watcher checked a handle NIXL had freed"
    eng.close(timeout=1)


def test_close_stops_the_watcher_thread(engine):
    eng, agent, xfer = engine
    over = Over()
    eng.when_over(xfer, over)
    thread = eng._watch._thread
    assert thread.is_alive()
    eng.close(timeout=5)  # releases the pending READ (disconnect: ERR), then stops the watcher
    assert not thread.is_alive(), "the watcher thread outlived close"
    assert over.states == ["failed"]


def test_progress_after_close_serves_nothing_and_does_not_fail(engine):
    """A pace the endpoint has not lifted yet may call ``progress`` once more after
    ``close`` dropped the agent: nothing is left to serve, and nothing may fail."""
    eng, agent, xfer = engine
    agent.states[xfer] = "DONE"
    eng.close(timeout=1)
    assert eng._agent is None
    eng.progress()
