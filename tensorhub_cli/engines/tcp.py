"""tcp engine: chunk reads over plain TCP, for hosts where NIXL will not load.

Reader side: ``read`` runs on a small thread pool; each read takes a pooled blocking
connection to the holder, sends a ``ReadBytes`` ask per pair and receives the bytes
with ``recv_into`` straight into the destination memory (no intermediate buffer).
Every socket has a timeout, so a silent holder fails the read instead of hanging it.

Holder side: ``serve_read`` (called by the endpoint's asyncio peer server) streams the
asked range from registered memory in 1 MiB slices, so at most one slice is buffered
per connection. ``TH_TEST_SERVE_BPS`` throttles serving (bytes/s): a test hook that
makes a read slow enough to unpublish under.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from . import wire
from .base import Engine, EngineError, Pair, Region, State

SLICE = 1 << 20


def host_view(addr: int, nbytes: int) -> memoryview:
    """A writable view of host memory at ``addr`` (registered memory only)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class Regions:
    """The memory an endpoint serves; every ask is checked against it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, list[Region]] = {}

    def add(self, key: int, regions: list[Region]) -> None:
        with self._lock:
            self._by_handle[key] = list(regions)

    def remove(self, key: int) -> None:
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


class TcpEngine(Engine):
    kind = "tcp"

    def __init__(self, token: str, *, timeout: float = 10.0, threads: int = 8, source: str | None = None):
        self._token = token
        self._timeout = timeout
        self._source = source
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="th-tcp")
        self._conns: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def register(self, regions: list[Region]) -> object:
        if any(r.device >= 0 for r in regions):
            raise EngineError("the tcp engine serves host memory only; use nixl for CUDA tensors")
        return object()  # what we serve is the endpoint's Regions, kept for every engine

    def describe(self, handle: object) -> bytes:
        return b""  # addresses are all a tcp reader needs

    def deregister(self, handle: object) -> None:
        pass

    def add_peer(self, address: str, description: bytes) -> object:
        return address

    def read(self, peer: object, pairs: list[Pair], device: int = -1) -> object:
        if device >= 0:
            raise EngineError("the tcp engine reads into host memory only")
        return self._pool.submit(self._read, str(peer), pairs)

    def _conn(self, address: str):
        with self._lock:
            idle = self._conns.setdefault(address, queue.SimpleQueue())
        try:
            return idle.get_nowait()
        except queue.Empty:
            return wire.dial(address, self._timeout, self._source)

    def _read(self, address: str, pairs: list[Pair]) -> None:
        sock = self._conn(address)
        try:
            for pair in pairs:
                ask = wire.ReadBytes(addr=pair.remote, nbytes=pair.nbytes)
                sock.sendall(wire.frame(wire.Ask(v=wire.WIRE_VERSION, token=self._token, op=ask)))
                body = wire.recv_answer(sock).body
                if not isinstance(body, wire.Bytes) or body.nbytes != pair.nbytes:
                    raise wire.PeerError(f"holder at {address} refused the read: {body}")
                wire.recv_exact(sock, host_view(pair.local, pair.nbytes))
        except BaseException:
            sock.close()  # a half-read stream is useless: never pool it again
            raise
        self._conns[address].put(sock)

    def state(self, transfer: object) -> State:
        fut: Future = transfer  # type: ignore[assignment]
        if not fut.done():
            return "pending"
        return "failed" if fut.exception() is not None else "done"

    def release(self, transfer: object) -> bool:
        fut: Future = transfer  # type: ignore[assignment]
        return fut.done() or fut.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for idle in self._conns.values():
                while not idle.empty():
                    idle.get_nowait().close()
