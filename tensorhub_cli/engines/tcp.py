"""tcp engine: chunk reads over plain TCP, for hosts where NIXL will not load.

Reader side: ``read`` runs on a small thread pool; each read takes a pooled blocking
connection to the holder and sends its pairs in batches of up to ``wire.MAX_RANGES``
(consecutive pairs; a read of thousands of small ranges, one per row of a column
slice, costs one round trip, not thousands): one ``ReadRanges`` ask per batch, or a
``ReadBytes`` for a batch of one pair (a whole chunk: what every holder understands).
It receives each pair's bytes with ``recv_into`` straight into the destination memory
(no intermediate buffer), in the order asked; pairs whose destinations follow each
other are received as one span.
Every socket has a timeout (``timeout``, default 10 s: one connect, send or receive),
so a silent holder fails the read instead of hanging it.

Pooled connections. The holder closes a connection idle for its ``PeerServer(idle_s=)``
(300 s by default); a read over such a connection would fail, and a healthy holder
would land in the reader's avoid list. So a connection unused for ``idle_s`` (default
``IDLE_S``, 60 s: well inside the holder's limit) is closed rather than reused, one the
holder closed is dropped when taken from the pool, and a read whose reused connection
turns out closed before any byte of its answer came (the holder closed it as the ask
went out) goes out again, once, on a fresh connection. Only that one counts.

Stopping a read. A read in flight cannot be abandoned while its thread may still
write into the target memory (contract 3: the hub must count it against its source
until it really ended). ``release`` of a pending read asks it to stop: a read not
started yet is cancelled; a running one has its socket shut down, which ends its
blocking receive at once, or its connect (the socket is the read's before it
connects: a holder whose link is down would hold a dial for the whole ``timeout``).
``release`` returns True only once the read's thread is done with the memory; until
then the caller keeps the transfer and asks again.

Completion. ``when_over(read, fn)`` hangs ``fn`` on the read's own future: it is
called by the read's pool thread as the read ends (or at once when it has), never by a
poll; a read cancelled or stopped reports "failed".

Closing. ``close(timeout)`` refuses new reads, stops every read still pending (as
``release`` does) and waits up to ``timeout`` (5 s) for their threads to end, so once
it returns no read of this engine writes into memory again. A read it could not see
end in time is logged by count: told to stop, it writes nothing more once its
receive of bytes already buffered returns.

Device memory. A read into CUDA memory (``device`` >= 0) receives each pair into a
pinned host staging buffer, then copies it to the device (``DeviceCopy``, synchronous)
before receiving the next; the read is done only once every copy returned, and a read stopped
mid-way wrote into the staging buffer, never into the target. The staging buffer is
one per read, as big as its largest pair (a chunk), and lives as long as the read.

Holder side: nothing here. The endpoint's peer server answers ``ReadBytes`` with
``engines.serve`` for every engine (which stages device memory the same way), so
registration accepts host and device memory alike.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from . import wire
from .base import DeviceCopy, Engine, EngineError, Pair, Region, State, TorchDeviceCopy, host_view
from .watcher import deliver


IDLE_S = 60.0
log = logging.getLogger("tensorhub.engine")


class _Stale(Exception):
    """A reused connection the holder had closed before answering: not a failed read."""


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

    def claim(self, sock: socket.socket) -> None:
        """``sock`` is this read's from now on, connecting yet or not: ``stop`` shuts
        it down (a dial to a holder whose link is down ends then, not at its timeout)."""
        with self.lock:
            if self.stopped:
                raise EngineError("read stopped before it started")
            self.sock = sock

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

    def __init__(self, token: str, *, timeout: float = 10.0, threads: int = 8, source: str | None = None,
                 idle_s: float = IDLE_S, device_copy: DeviceCopy | None = None):
        """``idle_s``: how long a pooled connection may sit unused before it is closed
        instead of reused (keep it below the holders' ``PeerServer(idle_s=)``);
        ``device_copy``: how reads into device memory reach it (default torch's)."""
        self._token = token
        self._copy = device_copy or TorchDeviceCopy()
        self._timeout = timeout
        self._idle_s = idle_s
        self._source = source
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="th-tcp")
        self._conns: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._reads: set[TcpRead] = set()  # not ended yet: what close must stop and wait for
        self._closed = False

    def register(self, regions: list[Region]) -> object:
        return object()  # what we serve is the endpoint's serve.Regions, kept for every engine

    def describe(self, handle: object) -> bytes:
        return b""  # addresses are all a tcp reader needs

    def deregister(self, handle: object) -> None:
        pass

    def add_peer(self, address: str, description: bytes) -> object:
        return address

    def read(self, peer: object, pairs: list[Pair], device: int = -1, remote_device: int | None = None) -> object:
        """``remote_device`` is not ours to use: the holder stages its own device memory."""
        xfer = TcpRead()
        with self._lock:  # (a read started beside close would escape its wait)
            if self._closed:
                raise EngineError("the tcp engine is closed")
            self._reads.add(xfer)
            xfer.future = self._pool.submit(self._read, str(peer), pairs, xfer, device)
        xfer.future.add_done_callback(lambda _: self._ended(xfer))
        return xfer

    def _ended(self, xfer: TcpRead) -> None:
        with self._lock:
            self._reads.discard(xfer)

    def _conn(self, address: str, xfer: TcpRead) -> tuple[socket.socket, bool]:
        """A connection to ``address``, and whether it was used before."""
        with self._lock:
            idle = self._conns.setdefault(address, queue.SimpleQueue())
        while True:
            try:
                sock, since = idle.get_nowait()
            except queue.Empty:
                return self._dial(address, xfer), False
            if time.monotonic() - since < self._idle_s and self._open(sock):
                return sock, True
            sock.close()

    def _dial(self, address: str, xfer: TcpRead) -> socket.socket:
        """A new connection for ``xfer``, which a stop aborts while it connects."""
        return wire.dial(address, self._timeout, self._source, claim=xfer.claim)

    def _open(self, sock: socket.socket) -> bool:
        """Whether an idle connection is still open: nothing to read yet (an end of
        stream, an error or unasked bytes all make it useless)."""
        try:
            sock.setblocking(False)
            try:
                sock.recv(1, socket.MSG_PEEK)
            finally:
                sock.settimeout(self._timeout)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def _read(self, address: str, pairs: list[Pair], xfer: TcpRead, device: int) -> None:
        staged = self._copy.staging(max(p.nbytes for p in pairs)) if device >= 0 and pairs else None
        sock, reused = self._conn(address, xfer)
        try:
            self._read_over(sock, address, pairs, xfer, reused, device, staged)
        except _Stale:
            sock = self._dial(address, xfer)
            self._read_over(sock, address, pairs, xfer, False, device, staged)

    def _read_over(self, sock: socket.socket, address: str, pairs: list[Pair], xfer: TcpRead, reused: bool,
                   device: int = -1, staged: tuple[int, object] | None = None) -> None:
        """Raises ``_Stale`` when ``reused`` and the holder had closed ``sock`` before
        any byte of the first answer came. ``staged``: the host staging buffer (its
        address, its keeper) a read into ``device`` memory receives into."""
        with xfer.lock:
            xfer.sock = sock
            stopped = xfer.stopped
        try:
            if stopped:
                raise EngineError("read stopped before it started")
            for i in range(0, len(pairs), wire.MAX_RANGES):
                batch = pairs[i:i + wire.MAX_RANGES]
                if len(batch) == 1:
                    ask = wire.ReadBytes(addr=batch[0].remote, nbytes=batch[0].nbytes)
                else:
                    ask = wire.ReadRanges(addrs=[p.remote for p in batch], sizes=[p.nbytes for p in batch])
                try:
                    sock.sendall(wire.frame(wire.Ask(v=wire.WIRE_VERSION, token=self._token, op=ask)))
                    closed = i == 0 and reused and sock.recv(1, socket.MSG_PEEK) == b""
                except (BrokenPipeError, ConnectionResetError):
                    closed = i == 0 and reused
                    if not closed:
                        raise
                if closed:
                    with xfer.lock:
                        stale = not xfer.stopped  # (a stop's shutdown also reads as closed)
                    if stale:
                        raise _Stale()
                    raise EngineError("read stopped")
                body = wire.recv_answer(sock).body
                if not isinstance(body, wire.Bytes) or body.nbytes != sum(p.nbytes for p in batch):
                    raise wire.PeerError(f"holder at {address} refused the read: {body}")
                if staged is None:
                    # Ranges that land back to back (a column slice read into staging,
                    # row after row) are received as one span.
                    for local, nbytes in _spans(batch):
                        wire.recv_exact(sock, host_view(local, nbytes))
                    continue
                for pair in batch:
                    wire.recv_exact(sock, host_view(staged[0], pair.nbytes))
                    self._copy.to_device(staged[0], pair.local, pair.nbytes, device)
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
            self._conns[address].put((sock, time.monotonic()))

    def state(self, transfer: object) -> State:
        fut: Future = transfer.future  # type: ignore[attr-defined]
        if not fut.done():
            return "pending"
        return "failed" if fut.cancelled() or fut.exception() is not None else "done"

    def when_over(self, transfer: object, fn) -> None:
        """``fn(state)`` once, from the read's completion (see the module's docstring)."""
        xfer: TcpRead = transfer  # type: ignore[assignment]
        xfer.future.add_done_callback(lambda _: deliver(fn, self.state(xfer)))

    def release(self, transfer: object) -> bool:
        """True once the read no longer touches its target memory; a pending read is
        told to stop (see the module's docstring) and confirms on a later call."""
        xfer: TcpRead = transfer  # type: ignore[assignment]
        if xfer.future.done() or xfer.future.cancel():
            return True
        xfer.stop()
        return xfer.future.done()

    def close(self, timeout: float = 5.0) -> None:
        """Stop every pending read and wait up to ``timeout`` seconds for each to end
        (see the module's docstring); then drop the pooled connections."""
        with self._lock:
            self._closed = True
            pending = list(self._reads)
        for xfer in pending:
            if not xfer.future.cancel():
                xfer.stop()
        _, running = wait_futures([x.future for x in pending], timeout=timeout)
        if running:
            log.warning("tcp engine closed with %d read(s) still running after %.1fs, told to stop",
                        len(running), timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for idle in self._conns.values():
                while not idle.empty():
                    idle.get_nowait()[0].close()


def _spans(pairs: list[Pair]) -> list[tuple[int, int]]:
    """(local address, bytes) of the pairs' destinations, consecutive ones merged."""
    out: list[list[int]] = []
    for pair in pairs:
        if out and out[-1][0] + out[-1][1] == pair.local:
            out[-1][1] += pair.nbytes
        else:
            out.append([pair.local, pair.nbytes])
    return [(a, n) for a, n in out]
