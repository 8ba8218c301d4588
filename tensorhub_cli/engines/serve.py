"""Holder side of ``ReadBytes`` and ``ReadRanges``: serving asked ranges of registered
host or device memory.

Protocol. The endpoint keeps one ``Regions`` for every engine: a replica's regions
are ``add``ed before the hub learns of them and ``remove``d before they are
deregistered, so an ask is checked against memory that is still ours. ``serve_read``
(called by the endpoint's asyncio peer server for each ``ReadBytes``; a ``ReadRanges``
is one) checks every asked range first: one not wholly inside one region we serve, an
empty one, or more than ``wire.MAX_RANGES`` of them, is answered ``Refused`` naming it,
with nothing else sent. Else it answers one ``Bytes`` of the total and the raw bytes of
every range in the order asked, streamed in 1 MiB slices (small ranges are drained
together, up to a slice's worth) so that at most about one slice is buffered per
connection. A range in device memory is sent through a pinned host
staging buffer (``Regions(device_copy=)``, default torch's): each slice is copied
device → staging (synchronous, on the loop's thread: one 1 MiB PCIe copy, not timed
on a GPU yet) and sent as bytes of its own, since the transport may still hold what it
was given when the next slice overwrites the staging buffer. A holder that cannot
stage (no CUDA after all, no pinned memory) answers ``Refused`` ("unservable").

The send holds a reference to what registered the range (``add``'s ``owner``: the
tensors) until it ends, so memory unpublished and dropped mid-send is never freed
under it. Each slice must drain within ``send_timeout`` (``SEND_TIMEOUT_S``, 30 s: a
reader that stops receiving would otherwise pin that reference, and its connection,
forever); past it the connection is closed.
``TH_TEST_SERVE_BPS`` throttles serving (bytes/s): a test hook that makes a read slow
enough to unpublish under.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import threading

from . import wire
from .base import DeviceCopy, Region, TorchDeviceCopy, host_view

SLICE = 1 << 20
SMALL_RANGE = 64 << 10  # host ranges below this are joined into one write (a copy, in C)
SEND_TIMEOUT_S = 30.0  # one slice (1 MiB) to a reader that still receives takes far less


class Regions:
    """The memory an endpoint serves; every ask is checked against it. Thread-safe."""

    def __init__(self, device_copy: DeviceCopy | None = None) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, tuple[list[Region], object]] = {}
        self.device_copy = device_copy or TorchDeviceCopy()
        # Every region by its start, for bisection: a ReadRanges ask checks thousands of
        # ranges (one per row of a column slice) against tens of regions.
        self._starts: list[int] = []
        self._sorted: list[tuple[int, int, object, int]] = []  # (start, end, owner, device)
        self._widest = 0

    def add(self, key: int, regions: list[Region], owner: object = None) -> None:
        """From now on asks inside ``regions`` are served; ``owner`` (what keeps the
        memory alive: the tensors) is held by every send from it until the send ends."""
        with self._lock:
            regions = list(regions)
            self._by_handle[key] = (regions, regions if owner is None else owner)
            self._index()

    def remove(self, key: int) -> None:
        """From now on no new ask inside them is served (a slice being sent finishes)."""
        with self._lock:
            self._by_handle.pop(key, None)
            self._index()

    def _index(self) -> None:
        self._sorted = sorted((r.addr, r.addr + r.nbytes, owner, r.device)
                              for regions, owner in self._by_handle.values() for r in regions)
        self._starts = [start for start, *_ in self._sorted]
        self._widest = max((end - start for start, end, *_ in self._sorted), default=0)

    def contains(self, addr: int, nbytes: int) -> bool:
        return self.owner(addr, nbytes) is not None

    def owner(self, addr: int, nbytes: int) -> object | None:
        """The owner of the host range ``addr .. addr + nbytes`` if we serve all of it."""
        found = self.find(addr, nbytes)
        return found[0] if found is not None and found[1] < 0 else None

    def find(self, addr: int, nbytes: int) -> tuple[object, int] | None:
        """(owner, device) of the range ``addr .. addr + nbytes`` if one region we
        serve holds all of it (device -1: host memory)."""
        with self._lock:
            # Regions that start at or before addr, nearest first; one that starts more
            # than the widest region's size before it cannot reach it.
            i = bisect.bisect_right(self._starts, addr) - 1
            while i >= 0 and addr - self._starts[i] < self._widest:
                start, end, owner, device = self._sorted[i]
                if addr + nbytes <= end:
                    return owner, device
                i -= 1
        return None


async def _drain(writer: asyncio.StreamWriter, timeout: float) -> None:
    try:
        await asyncio.wait_for(writer.drain(), timeout)
    except asyncio.TimeoutError:
        writer.close()
        raise ConnectionAbortedError(f"reader took more than {timeout:.0f}s to receive a slice; closed") from None


async def _answer(writer: asyncio.StreamWriter, body: object, send_timeout: float) -> None:
    writer.write(wire.frame(wire.Answer(body=body)))
    await _drain(writer, send_timeout)


def _check(regions: Regions, ask: wire.ReadBytes) -> tuple[list[tuple[int, int, int]], list[object]] | wire.Refused:
    """The asked ranges as (addr, nbytes, device) and the owners to hold while they are
    sent, or why the ask is refused (the first bad range, by index for a ``ReadRanges``)."""
    if not isinstance(ask, wire.ReadRanges):
        asked, name = [(ask.addr, ask.nbytes)], (lambda i: "")
    elif len(ask.addrs) != len(ask.sizes):
        return wire.Refused(code="malformed", message=f"{len(ask.addrs)} addrs but {len(ask.sizes)} sizes")
    elif not 0 < len(ask.addrs) <= wire.MAX_RANGES:
        return wire.Refused(code="too_large" if ask.addrs else "malformed",
                            message=f"{len(ask.addrs)} ranges asked; 1 to {wire.MAX_RANGES} may be")
    else:
        asked, name = list(zip(ask.addrs, ask.sizes)), (lambda i: f"range {i}: ")
    ranges, owners, seen = [], [], set()
    for i, (addr, nbytes) in enumerate(asked):
        found = regions.find(addr, nbytes) if nbytes > 0 else None
        if found is None:
            return wire.Refused(code="not_registered",
                                message=f"{name(i)}{nbytes} bytes at {addr:#x} are not memory this endpoint serves")
        owner, device = found
        if id(owner) not in seen:
            seen.add(id(owner))
            owners.append(owner)
        ranges.append((addr, nbytes, device))
    return ranges, owners


async def serve_read(writer: asyncio.StreamWriter, regions: Regions, ask: wire.ReadBytes, *,
                     send_timeout: float = SEND_TIMEOUT_S) -> None:
    """Raises ``ConnectionError`` (the connection closed) when a slice does not drain
    within ``send_timeout`` seconds."""
    checked = _check(regions, ask)
    if isinstance(checked, wire.Refused):
        await _answer(writer, checked, send_timeout)
        return
    ranges, owners = checked
    on_device = [n for _, n, device in ranges if device >= 0]
    try:
        staged = regions.device_copy.staging(min(SLICE, max(on_device))) if on_device else None
    except Exception as exc:  # (no CUDA here after all, out of pinned memory): say so, keep the connection
        device = next(d for _, _, d in ranges if d >= 0)
        await _answer(writer, wire.Refused(code="unservable",
                                           message=f"cannot stage cuda:{device} memory for sending: {exc}"),
                      send_timeout)
        return
    writer.write(wire.frame(wire.Answer(body=wire.Bytes(nbytes=sum(n for _, n, _ in ranges)))))
    rate = float(os.environ.get("TH_TEST_SERVE_BPS") or 0)
    unsent = 0  # written since the last drain
    small: list = []  # small host ranges (rows of a column slice), joined into one write

    def flush() -> None:
        if small:  # (a write per row would be a send(2) per row)
            writer.write(b"".join(small))
            small.clear()

    try:
        for addr, nbytes, device in ranges:
            for start in range(0, nbytes, SLICE):
                n = min(SLICE, nbytes - start)
                if device < 0 and n < SMALL_RANGE:
                    small.append(host_view(addr + start, n))
                else:
                    flush()
                    if device < 0:
                        writer.write(host_view(addr + start, n))
                    else:  # (a copy: the transport may still hold it when the staging buffer is reused)
                        regions.device_copy.from_device(addr + start, device, staged[0], n)
                        writer.write(bytes(host_view(staged[0], n)))
                unsent += n
                if unsent >= SLICE:
                    flush()
                    await _drain(writer, send_timeout)
                    if rate:
                        await asyncio.sleep(unsent / rate)
                    unsent = 0
        flush()
        if unsent:
            await _drain(writer, send_timeout)
            if rate:
                await asyncio.sleep(unsent / rate)
    finally:
        small.clear()
        del owners, staged  # (held to here on purpose: the raw views keep nothing alive)
