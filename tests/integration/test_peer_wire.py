"""The peer channel over a real socket: a holder serves only what it registered, only
to holders of the token; and an endpoint whose NIXL will not load falls back to tcp."""

from __future__ import annotations

import logging

import pytest
import torch

from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import Pair, Region
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.engines.tcp import TcpEngine
from tensorhub_cli.endpoint.peer import PeerServer

pytestmark = pytest.mark.integration
TOKEN = "k" * 32


@pytest.fixture
def served():
    buf = torch.arange(1 << 16, dtype=torch.int32)
    regions = Regions()
    regions.add(1, [Region(buf.data_ptr(), buf.nbytes)])
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="not_found", message="none"), regions)
    yield server, buf
    server.close()


def read(server, token: str, addr: int, nbytes: int):
    engine = TcpEngine(token, timeout=5)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    xfer = engine.read(engine.add_peer(server.address, b""), [Pair(addr, dst.data_ptr(), nbytes)])
    try:
        xfer.result(timeout=10)
        return dst, None
    except Exception as exc:
        return dst, exc
    finally:
        engine.close()


def test_a_registered_range_is_read_byte_for_byte(served):
    server, buf = served
    dst, exc = read(server, TOKEN, buf.data_ptr() + 400, 4000)
    assert exc is None
    assert torch.equal(dst, buf.view(torch.uint8)[400:4400])


@pytest.mark.parametrize("token, offset, nbytes, needle", [
    ("x" * 32, 0, 16, "bad token"),
    (TOKEN, -16, 32, "not memory this endpoint serves"),  # starts before the region
    (TOKEN, (1 << 18) - 8, 16, "not memory this endpoint serves"),  # runs past its end
])
def test_a_peer_gets_nothing_outside_what_it_may_read(served, token, offset, nbytes, needle):
    server, buf = served
    dst, exc = read(server, token, buf.data_ptr() + offset, nbytes)
    assert exc is not None and needle in str(exc)
    assert not dst.any()


def test_describe_refusals_reach_the_reader(served):
    server, _ = served
    with pytest.raises(wire.PeerError, match="refused describe of m@1: not_found"):
        wire.describe(server.address, TOKEN, "m", 1, timeout=5)


def test_an_endpoint_without_nixl_falls_back_to_tcp_with_one_warning(monkeypatch, caplog):
    from tensorhub_cli.engines.choice import make as make_engine

    monkeypatch.setenv("TH_NIXL_MODULE", "nixl_absent")
    with caplog.at_level(logging.WARNING, logger="tensorhub.endpoint"):
        engine, tcp = make_engine("nixl", "e", TOKEN, "127.0.0.1")
    assert engine is tcp and engine.kind == "tcp"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NIXL unavailable" in warnings[0] and "nixl_absent" in warnings[0]
    engine.close()
