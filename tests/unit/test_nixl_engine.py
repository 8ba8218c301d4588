"""The NIXL engine's bookkeeping with a fake agent (no UCX) that behaves as UCX does
when a READ in progress is released: the handle is freed without error, and the GET
goes on writing (NIXL issue #1958). A transfer is over only once NIXL reports it final."""

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
        self.posted: set = set()  # handles not freed yet
        self.n = 0

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, agent):
        self.n += 1
        return self.n

    def transfer(self, handle):
        self.posted.add(handle)
        self.states[handle] = "PROC"
        return "PROC"

    def check_xfer_state(self, handle):
        return self.states[handle]

    def release_xfer_handle(self, handle):
        self.posted.discard(handle)  # (UCX: no error, and a GET in progress is not stopped)


@pytest.fixture
def engine(monkeypatch):
    agent = FakeAgent()
    fake = SimpleNamespace(nixl_agent=lambda name, config: agent, nixl_agent_config=lambda **kw: None)
    monkeypatch.setattr(nixl_engine, "load_nixl", lambda: fake)
    eng = nixl_engine.NixlEngine("t")
    xfer = eng.read(nixl_engine.NixlPeer("remote", "DRAM", 0), [Pair(0x1000, 0x2000, 64)])
    return eng, agent, xfer


def test_a_read_in_progress_is_never_counted_stopped(engine):
    eng, agent, xfer = engine
    assert eng.release(xfer) is False, "a pending READ was counted stopped: it may still write our memory"
    assert xfer in agent.posted, "the handle of a READ still in progress was freed"
    assert eng.state(xfer) == "pending"


@pytest.mark.parametrize("final", ["DONE", "ERR"])
def test_a_read_is_released_once_nixl_reports_it_final(engine, final):
    eng, agent, xfer = engine
    assert not eng.release(xfer)
    agent.states[xfer] = final
    assert eng.release(xfer) is True and xfer not in agent.posted


def test_close_waits_for_posted_transfers_to_end_before_dropping_the_agent(engine):
    eng, agent, xfer = engine
    threading.Timer(0.1, agent.states.__setitem__, (xfer, "DONE")).start()
    eng.close(timeout=5)
    assert not agent.posted and eng._agent is None


def test_close_gives_up_after_its_timeout_and_keeps_the_agent(engine):
    eng, agent, xfer = engine
    start = time.monotonic()
    eng.close(timeout=0.2)
    assert time.monotonic() - start < 2
    assert agent.posted and eng._agent is agent  # leaked, not freed under UCX
