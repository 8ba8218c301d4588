"""Holder side of ``ReadBytes``: serving asked ranges of registered host memory.

Protocol. The endpoint keeps one ``Regions`` for every engine: a replica's regions
are ``add``ed before the hub learns of them and ``remove``d before they are
deregistered, so an ask is checked against memory that is still ours. ``serve_read``
(called by the endpoint's asyncio peer server for each ``ReadBytes``) answers
``Refused`` when the range is not wholly inside host memory we serve, else ``Bytes``
and exactly ``nbytes`` raw bytes, streamed in 1 MiB slices so that at most one slice
is buffered per connection. ``TH_TEST_SERVE_BPS`` throttles serving (bytes/s): a test
hook that makes a read slow enough to unpublish under.
"""

from __future__ import annotations

import asyncio
import os
import threading

from . import wire
from .base import Region, host_view

SLICE = 1 << 20


class Regions:
    """The memory an endpoint serves; every ask is checked against it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, list[Region]] = {}

    def add(self, key: int, regions: list[Region]) -> None:
        """From now on asks inside ``regions`` are served."""
        with self._lock:
            self._by_handle[key] = list(regions)

    def remove(self, key: int) -> None:
        """From now on no new ask inside them is served (a slice being sent finishes)."""
        with self._lock:
            self._by_handle.pop(key, None)

    def contains(self, addr: int, nbytes: int) -> bool:
        with self._lock:
            return any(r.device < 0 and r.addr <= addr and addr + nbytes <= r.addr + r.nbytes
                       for regions in self._by_handle.values() for r in regions)


async def serve_read(writer: asyncio.StreamWriter, regions: Regions, ask: wire.ReadBytes) -> None:
    if ask.nbytes <= 0 or not regions.contains(ask.addr, ask.nbytes):
        writer.write(wire.frame(wire.Answer(body=wire.Refused(
            code="not_registered", message=f"{ask.nbytes} bytes at {ask.addr:#x} are not memory this endpoint serves"))))
        await writer.drain()
        return
    writer.write(wire.frame(wire.Answer(body=wire.Bytes(nbytes=ask.nbytes))))
    rate = float(os.environ.get("TH_TEST_SERVE_BPS") or 0)
    view = host_view(ask.addr, ask.nbytes)
    for start in range(0, ask.nbytes, SLICE):
        writer.write(view[start:start + SLICE])
        await writer.drain()
        if rate:
            await asyncio.sleep(min(SLICE, ask.nbytes - start) / rate)
