"""tcp engine: chunk reads over plain TCP, for hosts where NIXL will not load.

Reader side: ``read`` runs on a small thread pool; each read takes a pooled blocking
connection to the holder, sends a ``ReadBytes`` ask per pair and receives the bytes
with ``recv_into`` straight into the destination memory (no intermediate buffer).
Every socket has a timeout (``timeout``, default 10 s: one connect, send or receive),
so a silent holder fails the read instead of hanging it.

Holder side: nothing here. The endpoint's peer server answers ``ReadBytes`` with
``engines.serve`` for every engine, so registration only refuses device memory.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from . import wire
from .base import Engine, EngineError, Pair, Region, State, host_view


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
        return object()  # what we serve is the endpoint's serve.Regions, kept for every engine

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
