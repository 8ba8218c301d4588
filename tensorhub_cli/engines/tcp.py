"""tcp engine: chunk reads over plain TCP, for hosts where NIXL will not load.

Reader side: ``read`` runs on a small thread pool; each read takes a pooled blocking
connection to the holder, sends a ``ReadBytes`` ask per pair and receives the bytes
with ``recv_into`` straight into the destination memory (no intermediate buffer).
Every socket has a timeout (``timeout``, default 10 s: one connect, send or receive),
so a silent holder fails the read instead of hanging it.

Stopping a read. A read in flight cannot be abandoned while its thread may still
write into the target memory (contract 3: the hub must count it against its source
until it really ended). ``release`` of a pending read asks it to stop: a read not
started yet is cancelled; a running one has its socket shut down, which ends its
blocking receive at once. ``release`` returns True only once the read's thread is
done with the memory; until then the caller keeps the transfer and asks again.

Holder side: nothing here. The endpoint's peer server answers ``ReadBytes`` with
``engines.serve`` for every engine, so registration only refuses device memory.
"""

from __future__ import annotations

import queue
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from . import wire
from .base import Engine, EngineError, Pair, Region, State, host_view


class TcpRead:
    """One read: its future, and what stopping it needs (the socket it is blocked on)."""

    __slots__ = ("future", "stopped", "sock", "lock")

    def __init__(self) -> None:
        self.future: Future | None = None
        self.stopped = False
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def result(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` for the read; raises what it failed with."""
        return self.future.result(timeout)

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            if self.sock is not None:
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)  # the blocked recv_into returns at once
                except OSError:
                    pass


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
        xfer = TcpRead()
        xfer.future = self._pool.submit(self._read, str(peer), pairs, xfer)
        return xfer

    def _conn(self, address: str):
        with self._lock:
            idle = self._conns.setdefault(address, queue.SimpleQueue())
        try:
            return idle.get_nowait()
        except queue.Empty:
            return wire.dial(address, self._timeout, self._source)

    def _read(self, address: str, pairs: list[Pair], xfer: TcpRead) -> None:
        sock = self._conn(address)
        with xfer.lock:
            xfer.sock = sock
            stopped = xfer.stopped
        try:
            if stopped:
                raise EngineError("read stopped before it started")
            for pair in pairs:
                ask = wire.ReadBytes(addr=pair.remote, nbytes=pair.nbytes)
                sock.sendall(wire.frame(wire.Ask(v=wire.WIRE_VERSION, token=self._token, op=ask)))
                body = wire.recv_answer(sock).body
                if not isinstance(body, wire.Bytes) or body.nbytes != pair.nbytes:
                    raise wire.PeerError(f"holder at {address} refused the read: {body}")
                wire.recv_exact(sock, host_view(pair.local, pair.nbytes))
        except BaseException:
            with xfer.lock:
                xfer.sock = None
            sock.close()  # a half-read stream is useless: never pool it again
            raise
        with xfer.lock:
            xfer.sock = None
            stopped = xfer.stopped
        if stopped:  # a shutdown may have landed after the last byte: the socket is spent
            sock.close()
        else:
            self._conns[address].put(sock)

    def state(self, transfer: object) -> State:
        fut: Future = transfer.future  # type: ignore[attr-defined]
        if not fut.done():
            return "pending"
        return "failed" if fut.cancelled() or fut.exception() is not None else "done"

    def release(self, transfer: object) -> bool:
        """True once the read no longer touches its target memory; a pending read is
        told to stop (see the module's docstring) and confirms on a later call."""
        xfer: TcpRead = transfer  # type: ignore[assignment]
        if xfer.future.done() or xfer.future.cancel():
            return True
        xfer.stop()
        return xfer.future.done()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for idle in self._conns.values():
                while not idle.empty():
                    idle.get_nowait().close()
