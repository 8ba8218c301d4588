"""The tcp engine and the holder's serving reach device memory through host staging.

No CUDA here: the "device" memory is host memory labelled with a device id, and the
device copy boundary (``DeviceCopy``) is a fake that records each copy and checks that
nothing else touched the device side: a reader receives into its staging buffer and
only the copy writes the target; a holder sends what the copy staged, slice by slice."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tensorhub_cli.endpoint.peer import PeerServer
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import DeviceCopy, Pair, Region, host_view
from tensorhub_cli.engines.serve import SLICE, Regions
from tensorhub_cli.engines.tcp import TcpEngine

TOKEN = "t"


class FakeCopy(DeviceCopy):
    def __init__(self, fail_staging: bool = False):
        self.calls: list[tuple] = []
        self.untouched_before_copy: list[bool] = []
        self.fail_staging = fail_staging

    def staging(self, nbytes):
        if self.fail_staging:
            raise RuntimeError("no CUDA on this host")
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        self.calls.append(("staging", nbytes))
        return buf.data_ptr(), buf

    def to_device(self, host, addr, nbytes, device):
        self.calls.append(("to_device", host, addr, nbytes, device))
        self.untouched_before_copy.append(not any(host_view(addr, nbytes)))
        ctypes.memmove(addr, host, nbytes)

    def from_device(self, addr, device, host, nbytes):
        self.calls.append(("from_device", addr, device, nbytes))
        ctypes.memmove(host, addr, nbytes)


@pytest.fixture
def holder():
    servers = []

    def start(src: torch.Tensor, device: int, copy: FakeCopy) -> PeerServer:
        regions = Regions(device_copy=copy)
        regions.add(1, [Region(src.data_ptr(), src.nbytes, device)], owner=src)
        servers.append(PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), regions))
        return servers[-1]

    yield start
    for server in servers:
        server.close(timeout=5)


@pytest.fixture
def reader():
    engines = []

    def make(copy: FakeCopy) -> TcpEngine:
        engines.append(TcpEngine(TOKEN, timeout=5.0, device_copy=copy))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def test_a_read_from_cuda3_into_cuda1_is_staged_on_both_sides(holder, reader):
    n = 2 * SLICE + SLICE // 2  # three slices at the holder
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    held, read = FakeCopy(), FakeCopy()
    server = holder(src, 3, held)
    engine = reader(read)
    dst = torch.zeros(n, dtype=torch.uint8)
    half = n // 2
    pairs = [Pair(src.data_ptr(), dst.data_ptr(), half), Pair(src.data_ptr() + half, dst.data_ptr() + half, n - half)]

    engine.read(server.address, pairs, 1, remote_device=3).result(timeout=10)

    assert torch.equal(dst, src)
    # Reader: one staging buffer (the largest pair), each pair copied to cuda:1 from it.
    assert read.calls[0] == ("staging", n - half)
    copies = [c for c in read.calls if c[0] == "to_device"]
    assert [(c[2], c[3], c[4]) for c in copies] == [(dst.data_ptr(), half, 1), (dst.data_ptr() + half, n - half, 1)]
    assert all(c[1] not in range(dst.data_ptr(), dst.data_ptr() + n) for c in copies)  # from staging, not dst
    assert read.untouched_before_copy == [True, True]  # nothing received straight into the target
    # Holder: each asked range copied off cuda:3 in slices, exactly once.
    offs = [(c[1] - src.data_ptr(), c[3]) for c in held.calls if c[0] == "from_device"]
    assert {c[2] for c in held.calls if c[0] == "from_device"} == {3}
    assert sorted(offs) == [(0, SLICE), (SLICE, half - SLICE), (half, SLICE), (half + SLICE, n - half - SLICE)]


def test_host_memory_never_goes_through_the_device_copy(holder, reader):
    src = torch.arange(1 << 16, dtype=torch.uint8)
    held, read = FakeCopy(), FakeCopy()
    server = holder(src, -1, held)
    dst = torch.zeros_like(src)
    reader(read).read(server.address, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)]).result(timeout=10)
    assert torch.equal(dst, src)
    assert held.calls == [] and read.calls == []


def test_device_memory_is_registered_and_a_holder_that_cannot_stage_refuses_the_read(holder, reader):
    src = torch.ones(4096, dtype=torch.uint8)
    server = holder(src, 2, FakeCopy(fail_staging=True))
    engine = reader(FakeCopy())
    engine.register([Region(src.data_ptr(), src.nbytes, 2)])  # serving device memory is serve's job
    dst = torch.zeros_like(src)
    xfer = engine.read(server.address, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)], 1)
    with pytest.raises(wire.PeerError, match="unservable.*cannot stage cuda:2 memory"):
        xfer.result(timeout=10)
    assert engine.state(xfer) == "failed" and not dst.any()
