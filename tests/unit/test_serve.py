"""Holder-side serving (engines.serve): a send keeps the registered memory alive and
gives up on a reader that stops receiving."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest
import torch

from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import Region
from tensorhub_cli.engines.serve import Regions, serve_read


class StuckWriter:
    """A reader's connection whose receive window never opens again."""

    def __init__(self):
        self.sent = 0
        self.closed = False

    def write(self, data) -> None:
        self.sent += len(data)

    async def drain(self) -> None:
        await asyncio.Event().wait()

    def close(self) -> None:
        self.closed = True


class Owner:
    def __init__(self, nbytes: int):
        self.tensor = torch.ones(nbytes, dtype=torch.uint8)


def test_a_send_to_a_reader_that_stopped_receiving_is_closed_after_the_timeout():
    owner = Owner(4 << 20)
    regions = Regions()
    regions.add(1, [Region(owner.tensor.data_ptr(), owner.tensor.nbytes)], owner=owner)
    writer = StuckWriter()
    start = time.monotonic()
    ask = wire.ReadBytes(addr=owner.tensor.data_ptr(), nbytes=4 << 20)
    with pytest.raises(ConnectionError):
        asyncio.run(asyncio.wait_for(serve_read(writer, regions, ask, send_timeout=0.2), 5))
    assert time.monotonic() - start < 2 and writer.closed


def test_a_send_keeps_the_registered_tensors_alive_after_they_are_dropped():
    owner = Owner(2 << 20)
    addr, nbytes = owner.tensor.data_ptr(), owner.tensor.nbytes
    alive = weakref.ref(owner)
    regions = Regions()
    regions.add(1, [Region(addr, nbytes)], owner=owner)
    del owner

    async def run() -> bool:
        send = asyncio.ensure_future(serve_read(StuckWriter(), regions, wire.ReadBytes(addr=addr, nbytes=nbytes),
                                                send_timeout=0.5))
        await asyncio.sleep(0.05)  # the send is blocked in its first slice
        regions.remove(1)  # unpublished and dropped by its endpoint mid-send
        gc.collect()
        held = alive() is not None
        with pytest.raises(ConnectionError):
            await send
        return held

    assert asyncio.run(run()), "the memory being sent was freed under the send"
    gc.collect()
    assert alive() is None  # and let go once the send ended


def test_regions_find_agrees_with_a_scan_of_every_region():
    """``find`` bisects a sorted index; a brute-force scan is the oracle."""
    import random

    from tensorhub_cli.engines.base import Region
    from tensorhub_cli.engines.serve import Regions

    rng = random.Random(7)
    for _ in range(200):
        regs, spans = Regions(), []
        for key in range(rng.randint(1, 6)):
            mine = [Region(rng.randrange(0, 400), rng.randrange(0, 120), rng.choice([-1, 0]))
                    for _ in range(rng.randint(1, 3))]
            regs.add(key, mine, owner=key)
            spans += [(r, key) for r in mine]
        for _ in range(50):
            addr, n = rng.randrange(0, 520), rng.randrange(1, 60)
            hits = {(key, r.device) for r, key in spans if r.addr <= addr and addr + n <= r.addr + r.nbytes}
            got = regs.find(addr, n)
            assert (got is None) == (not hits) and (got is None or got in hits), (addr, n, spans)
        regs.remove(0)
