"""Many ranges in one tcp read: a column slice of a row-major tensor (one range per row)
costs one ``ReadRanges`` ask, lands byte for byte, and a single bad range refuses the
whole ask with nothing written. Asks are counted where the peer server hands them to
``engines.serve``."""

from __future__ import annotations

import asyncio
import ctypes

import msgspec
import pytest
import torch

from tensorhub_cli.endpoint import peer
from tensorhub_cli.endpoint.peer import PeerServer
from tensorhub_cli.engines import serve, wire
from tensorhub_cli.engines.base import DeviceCopy, Pair, Region, host_view
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.engines.tcp import TcpEngine

TOKEN = "t"


class FakeCopy(DeviceCopy):
    """'Device' memory is host memory; records every copy across the boundary."""

    def __init__(self):
        self.to: list[int] = []  # target addrs of reader-side copies
        self.off: list[int] = []  # source addrs of holder-side copies
        self.untouched_before_copy: list[bool] = []

    def staging(self, nbytes):
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        return buf.data_ptr(), buf

    def to_device(self, host, addr, nbytes, device):
        self.to.append(addr)
        self.untouched_before_copy.append(not any(host_view(addr, nbytes)))
        ctypes.memmove(addr, host, nbytes)

    def from_device(self, addr, device, host, nbytes):
        self.off.append(addr)
        ctypes.memmove(host, addr, nbytes)


@pytest.fixture
def asks(monkeypatch):
    """Every read ask a peer server serves, in order."""
    seen: list[wire.ReadBytes] = []
    real = peer.serve_read

    async def counting(writer, regions, ask, **kw):
        seen.append(ask)
        await real(writer, regions, ask, **kw)

    monkeypatch.setattr(peer, "serve_read", counting)
    return seen


@pytest.fixture
def holder():
    servers = []

    def start(regions: Regions) -> PeerServer:
        servers.append(PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), regions))
        return servers[-1]

    yield start
    for server in servers:
        server.close(timeout=5)


@pytest.fixture
def engine():
    engines = []

    def make(**kw) -> TcpEngine:
        engines.append(TcpEngine(TOKEN, timeout=5.0, **kw))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def column_pairs(src: torch.Tensor, dst: torch.Tensor, col: int) -> list[Pair]:
    """One pair per row: ``src[r, col:col + dst.shape[1]]`` into row ``r`` of ``dst``."""
    row, width = src.stride(0) * src.element_size(), dst.shape[1] * dst.element_size()
    skip = col * src.element_size()
    return [Pair(src.data_ptr() + r * row + skip, dst.data_ptr() + r * width, width) for r in range(src.shape[0])]


def host_regions(*tensors: torch.Tensor) -> Regions:
    regions = Regions()
    for i, t in enumerate(tensors):
        regions.add(i, [Region(t.data_ptr(), t.nbytes)], owner=t)
    return regions


def test_a_column_slice_of_2000_rows_is_one_ask_and_lands_byte_for_byte(holder, engine, asks):
    src = torch.randint(-2**31, 2**31 - 1, (2000, 64), dtype=torch.int32)
    server = holder(host_regions(src))
    reader = engine()
    for col in (16, 3):  # the second read reuses the pooled connection: the first left it in step
        dst = torch.zeros(2000, 16, dtype=torch.int32)
        reader.read(server.address, column_pairs(src, dst, col)).result(timeout=10)
        assert torch.equal(dst, src[:, col:col + 16])
    assert [type(a) for a in asks] == [wire.ReadRanges, wire.ReadRanges]
    assert len(asks[0].addrs) == 2000
    # a single pair stays a plain ReadBytes, which every holder understands
    one = torch.zeros(64, dtype=torch.int32)
    reader.read(server.address, [Pair(src.data_ptr(), one.data_ptr(), one.nbytes)]).result(timeout=10)
    assert type(asks[-1]) is wire.ReadBytes and torch.equal(one, src[0])


def test_more_ranges_than_an_ask_may_carry_go_out_in_a_few_asks(holder, engine, asks, monkeypatch):
    monkeypatch.setattr(wire, "MAX_RANGES", 64)
    src = torch.arange(193 * 32, dtype=torch.int32).view(193, 32)  # 3 full asks and 1 pair
    server = holder(host_regions(src))
    dst = torch.zeros(193, 5, dtype=torch.int32)
    engine().read(server.address, column_pairs(src, dst, 7)).result(timeout=10)
    assert torch.equal(dst, src[:, 7:12])
    assert [len(a.addrs) for a in asks[:3]] == [64, 64, 64] and [type(a) for a in asks[3:]] == [wire.ReadBytes]


def test_one_range_outside_what_is_served_refuses_the_read_and_writes_nothing(holder, engine, asks):
    src = torch.ones(100, 64, dtype=torch.uint8)
    server = holder(host_regions(src))
    dst = torch.zeros(100, 8, dtype=torch.uint8)
    pairs = column_pairs(src, dst, 0)
    pairs[57] = Pair(src.data_ptr() + src.nbytes - 4, pairs[57].local, 8)  # runs 4 bytes past the region's end
    reader = engine()
    xfer = reader.read(server.address, pairs)
    with pytest.raises(wire.PeerError, match=r"not_registered.*range 57: 8 bytes at 0x[0-9a-f]+ are not memory"):
        xfer.result(timeout=10)
    assert reader.state(xfer) == "failed" and not dst.any()
    assert len(asks) == 1


def test_ranges_across_host_and_device_regions_are_staged_only_where_on_a_device(holder, engine):
    host = torch.randint(0, 256, (300, 40), dtype=torch.uint8)
    dev = torch.randint(0, 256, (300, 40), dtype=torch.uint8)
    held, read = FakeCopy(), FakeCopy()
    regions = Regions(device_copy=held)
    regions.add(1, [Region(host.data_ptr(), host.nbytes)], owner=host)
    regions.add(2, [Region(dev.data_ptr(), dev.nbytes, 3)], owner=dev)
    server = holder(regions)
    a, b = torch.zeros(300, 10, dtype=torch.uint8), torch.zeros(300, 10, dtype=torch.uint8)
    pairs = [p for two in zip(column_pairs(host, a, 5), column_pairs(dev, b, 30)) for p in two]  # interleaved

    engine(device_copy=read).read(server.address, pairs, 1, remote_device=3).result(timeout=10)

    assert torch.equal(a, host[:, 5:15]) and torch.equal(b, dev[:, 30:40])
    assert held.off == [p.remote for p in pairs[1::2]]  # only the device ranges were copied off it
    assert read.to == [p.local for p in pairs] and all(read.untouched_before_copy)


class Recorder:
    def __init__(self):
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += bytes(data)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def only_answer(data: bytes) -> wire.Answer:
    n = int.from_bytes(data[:4], "big")
    assert len(data) == 4 + n, "bytes were sent beside the refusal"
    return msgspec.msgpack.decode(data[4:], type=wire.Answer)


@pytest.mark.parametrize("addrs, sizes, needle", [
    ("many", None, "too_large"),
    ([], [], "malformed"),
    ([0], [1, 2], "malformed"),
    ("base", [8, 0], "range 1: 0 bytes"),
])
def test_a_holder_refuses_a_bad_ranges_ask_whole(addrs, sizes, needle):
    src = torch.ones(1024, dtype=torch.uint8)
    regions = host_regions(src)
    if addrs == "many":
        addrs, sizes = [src.data_ptr()] * (wire.MAX_RANGES + 1), [1] * (wire.MAX_RANGES + 1)
    elif addrs == "base":
        addrs = [src.data_ptr(), src.data_ptr() + 8]
    writer = Recorder()
    asyncio.run(serve.serve_read(writer, regions, wire.ReadRanges(addrs=addrs, sizes=sizes)))
    body = only_answer(bytes(writer.data)).body
    assert isinstance(body, wire.Refused) and needle in f"{body.code}: {body.message}"
