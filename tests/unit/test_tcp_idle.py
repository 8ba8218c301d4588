"""Pooled tcp connections against the holder's idle close: a connection the holder
closed is never a failed read (it would put a healthy holder in the avoid list)."""

from __future__ import annotations

import time

import pytest
import torch

from tensorhub_cli.endpoint.peer import PeerServer
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import Pair, Region
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.engines.tcp import TcpEngine

TOKEN = "t"


@pytest.fixture
def holder():
    src = torch.arange(1 << 16, dtype=torch.uint8)
    regions = Regions()
    regions.add(1, [Region(src.data_ptr(), src.nbytes)], owner=src)
    servers = []

    def start(idle_s: float) -> tuple[PeerServer, torch.Tensor]:
        servers.append(PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), regions,
                                  idle_s=idle_s))
        return servers[-1], src

    yield start
    for server in servers:
        server.close(timeout=5)


def read_once(engine: TcpEngine, server: PeerServer, src: torch.Tensor) -> None:
    dst = torch.zeros_like(src)
    xfer = engine.read(server.address, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
    xfer.result(timeout=10)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("seen", ["in the pool", "only once the ask went out"])
def test_a_read_over_a_connection_the_holder_closed_when_idle_goes_out_on_a_fresh_one(holder, seen):
    server, src = holder(idle_s=0.2)
    engine = TcpEngine(TOKEN, timeout=5.0, idle_s=60.0)  # the pool keeps it past the holder's limit
    if seen != "in the pool":  # the holder closes it just as we take it: the read finds out
        engine._open = lambda sock: True
    try:
        read_once(engine, server, src)
        time.sleep(0.6)  # the holder closes the pooled connection
        read_once(engine, server, src)
        read_once(engine, server, src)
    finally:
        engine.close()


def test_the_pool_drops_connections_idle_longer_than_its_limit(holder):
    server, src = holder(idle_s=60.0)
    engine = TcpEngine(TOKEN, timeout=5.0, idle_s=0.1)
    try:
        read_once(engine, server, src)
        (idle,) = engine._conns.values()
        first = idle.get_nowait()
        idle.put(first)
        time.sleep(0.3)
        read_once(engine, server, src)
        assert first[0].fileno() == -1, "a connection idle past the pool's limit was used again"
    finally:
        engine.close()
