"""The NIXL engine's bookkeeping with a fake agent (no UCX): close releases what is
posted before it drops the agent, within a bound."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tensorhub_cli.engines import nixl as nixl_engine
from tensorhub_cli.engines.base import Pair


class FakeAgent:
    def __init__(self, busy_releases: int):
        self.busy_releases = busy_releases  # releases refused before one succeeds (-1: never)
        self.posted: set = set()
        self.n = 0

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def initialize_xfer(self, op, local, remote, agent):
        self.n += 1
        return self.n

    def transfer(self, handle):
        self.posted.add(handle)
        return "PROC"

    def check_xfer_state(self, handle):
        return "PROC"

    def release_xfer_handle(self, handle):
        if self.busy_releases != 0:
            self.busy_releases -= 1
            raise RuntimeError("NIXL_ERR_BACKEND: transfer in progress")
        self.posted.discard(handle)


@pytest.fixture
def engine(monkeypatch):
    def make(agent: FakeAgent):
        fake = SimpleNamespace(nixl_agent=lambda name, config: agent, nixl_agent_config=lambda **kw: None)
        monkeypatch.setattr(nixl_engine, "load_nixl", lambda: fake)
        return nixl_engine.NixlEngine("t")
    return make


def test_close_releases_posted_transfers_before_dropping_the_agent(engine):
    agent = FakeAgent(busy_releases=3)
    eng = engine(agent)
    eng.read(nixl_engine.NixlPeer("remote", "DRAM", 0), [Pair(0x1000, 0x2000, 64)])
    eng.close()
    assert not agent.posted, "the agent was dropped with a transfer still posted"


def test_close_gives_up_after_its_timeout_and_keeps_the_agent(engine):
    agent = FakeAgent(busy_releases=-1)
    eng = engine(agent)
    eng.read(nixl_engine.NixlPeer("remote", "DRAM", 0), [Pair(0x1000, 0x2000, 64)])
    start = time.monotonic()
    eng.close(timeout=0.2)
    assert time.monotonic() - start < 2
    assert agent.posted and eng._agent is agent  # leaked, not freed under UCX
