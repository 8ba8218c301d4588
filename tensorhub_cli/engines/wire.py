"""The peer channel: what a reader asks a holder directly, over TCP.

Framing: a 4-byte big-endian length, then a msgpack ``Ask`` (or ``Answer``). Every ask
carries the cluster token, compared in constant time; a frame over ``MAX_ASK`` or with
a bad token is answered ``Refused`` and the connection closed. The asks:

- ``Describe(model, version)``: the holder answers ``Described`` with the address of
  each chunk it holds memory for (a publisher: its shard's; a reader: every chunk), the
  device that memory is on (-1: host; N: CUDA device N) and its engine's description
  (NIXL agent metadata, which names the device too), so that the reader's engine can
  read, naming both devices.
  This is how NIXL metadata travels without NIXL's own unauthenticated listener.
- ``ReadBytes(addr, nbytes)``: the tcp engine's read. The holder answers ``Bytes`` and
  then exactly ``nbytes`` raw bytes from its registered memory, or ``Refused`` when the
  range is not inside memory it registered: a peer can read what we serve, nothing else.
- ``ReadRanges(addrs, sizes)``: many ranges in one ask (a reader of a column slice reads
  one range per row: one round trip, not thousands). The holder answers ONE
  ``Bytes(nbytes=sum(sizes))`` and then the bytes of every range, in the order asked, or
  ``Refused`` naming the first range not inside memory it registered, having sent
  nothing of any. At most ``MAX_RANGES`` ranges, each of at least one byte, in an ask.
  Added under the same ``WIRE_VERSION``: ``Describe`` and ``ReadBytes`` are unchanged, and
  a holder that predates it answers the unknown tag ``Refused`` (malformed), never wrong
  bytes.
- ``Await(model, version, chunks, timeout_s)``: a holder notice. ``chunks`` is a
  little-endian bitmask of global chunk ids (as ``hub.protocol.Plan.want``). The holder
  answers ONE ``Have(chunks)``: the asked chunks it holds (a reader: verified, in its
  replica's ``held``; a publisher: every chunk of its shard), as soon as it holds at least
  one of them (at once if it already does), or an empty mask once ``timeout_s`` passed
  (the holder caps the wait: ``endpoint.peer.AWAIT_CAP_S``, 30 s). It never polls: its
  replica wakes the wait when a chunk is marked held (``replica.Replica.mark_held``). A
  holder without that version, or whose replica is dropped while the ask waits, answers
  ``Refused(not_found)`` naming it; an ask naming no chunk, a chunk past the version's
  last, or a ``timeout_s`` that is not a finite number >= 0 is ``Refused(bad_request)``
  naming the field. The connection stays open after any of these answers.
  Added under the same ``WIRE_VERSION`` as ``ReadRanges``: a holder that predates it
  answers the unknown tag ``Refused`` (malformed) and closes the connection, which
  ``await_chunks`` raises as ``PeerError``; a reader that must work with such holders
  falls back to asking the hub.
  Fragments (a relay's chunk in fragments, ``endpoint.reader``): an ``Await`` with ``after``
  (chunk -> bytes) also ends once one of those chunks has more bytes landed at the
  holder, from its first byte, than ``after`` names (landed: read, not yet verified);
  ``Have.landed`` then gives, for asked chunks not held, the bytes landed. Absent
  ``after``, a holder answers as before, and a holder that predates the field decodes
  the ask without it (msgspec skips unknown fields) and answers only what it holds,
  which the reader takes as it always did.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Callable, Optional, Union

import msgspec

WIRE_VERSION = 1
MAX_ASK = 1 << 20
MAX_ANSWER = 64 << 20  # a Described of ~8M chunks; bigger is a bug
# At most 18 bytes a range in msgpack (two uint64), so a full ask stays well inside MAX_ASK.
MAX_RANGES = 1 << 15
_LEN = struct.Struct(">I")


class Describe(msgspec.Struct, tag="describe"):
    model: str
    version: int


class ReadBytes(msgspec.Struct, tag="read"):
    addr: int
    nbytes: int


class ReadRanges(ReadBytes, tag="ranges", kw_only=True):
    """A ``ReadBytes`` of many ranges. It subclasses ``ReadBytes`` so that whatever routes
    reads to ``engines.serve`` (the peer server's ``isinstance(op, ReadBytes)``) routes
    these too; the inherited ``addr``/``nbytes`` stay 0, so code that took one for a
    plain ``ReadBytes`` would ask for nothing and be refused, never serve wrong bytes."""
    addrs: list[int]
    sizes: list[int]
    addr: int = 0
    nbytes: int = 0


assert MAX_RANGES * 18 + 4096 < MAX_ASK  # (a token of up to 4 KiB beside the ranges)


class Await(msgspec.Struct, tag="await"):
    model: str
    version: int
    chunks: bytes  # little-endian bitmask of global chunk ids (``mask_bytes``)
    timeout_s: float
    after: Optional[dict[int, int]] = None  # fragments: chunk -> landed bytes already known


class ReadDelta(msgspec.Struct, tag="delta"):
    model: str
    version: int
    base: int  # the version the reader holds the chunk of
    index: int  # the chunk's index in the holder's ``Described.addrs``


class Ask(msgspec.Struct):
    v: int
    token: str
    op: Union[Describe, ReadRanges, ReadBytes, Await, ReadDelta]


class Described(msgspec.Struct, tag="described"):
    engine: str
    description: bytes
    rank: int  # >= 0: addrs are that shard's chunks; -1: every global chunk
    addrs: list[int]
    device: int = -1  # the holder's memory: -1 host, N CUDA device N (a read names it as remote_device)


class Bytes(msgspec.Struct, tag="bytes"):
    nbytes: int


class DeltaBytes(msgspec.Struct, tag="deltabytes"):
    nbytes: int
    full: bool  # the chunk itself, not a delta (a delta would not have been smaller)


class Have(msgspec.Struct, tag="have"):
    chunks: bytes  # the asked chunks held (little-endian bitmask); empty: none within the wait
    landed: dict[int, int] = {}  # fragments: asked chunks not held -> bytes landed (unverified)


class Refused(msgspec.Struct, tag="refused"):
    code: str
    message: str


class Answer(msgspec.Struct):
    body: Union[Described, Bytes, Have, DeltaBytes, Refused]


_enc = msgspec.msgpack.Encoder()
_ask = msgspec.msgpack.Decoder(Ask)
_answer = msgspec.msgpack.Decoder(Answer)


class PeerError(Exception):
    pass


def mask_bytes(mask: int) -> bytes:
    """A chunk set as ``Await``/``Have`` carry it: little-endian bitmask, b"" for none."""
    return mask.to_bytes((mask.bit_length() + 7) // 8, "little")


def mask_int(chunks: bytes) -> int:
    return int.from_bytes(chunks, "little")


def frame(msg: Ask | Answer) -> bytes:
    body = _enc.encode(msg)
    return _LEN.pack(len(body)) + body


def decode_ask(body: bytes) -> Ask:
    return _ask.decode(body)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerError("holder closed the connection mid-answer")
        got += n


def recv_answer(sock: socket.socket) -> Answer:
    head = bytearray(4)
    recv_exact(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_ANSWER:
        raise PeerError(f"answer of {n} bytes exceeds {MAX_ANSWER}")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    try:
        return _answer.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerError(f"undecodable answer: {exc}") from None


def dial(address: str, timeout: float, source: Optional[str] = None,
         claim: Optional[Callable[[socket.socket], None]] = None) -> socket.socket:
    """A connection to ``address`` whose connect and every later send and receive
    give up after ``timeout`` seconds (``socket.timeout``, an ``OSError``).
    ``claim(sock)`` is called with the socket before it connects, so another thread
    can abort the connect by shutting the socket down (Linux ends a blocked connect at
    once then: a holder whose link is down otherwise holds it for ``timeout``); what
    ``claim`` raises aborts the dial (the socket is closed)."""
    host, _, port = address.rpartition(":")
    try:
        found = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise PeerError(f"cannot reach holder at {address}: {exc}") from None
    error: OSError | None = None
    for family, kind, proto, _, where in found:  # (as socket.create_connection tries them)
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            if source:
                sock.bind((source, 0))
            if claim is not None:
                claim(sock)
            sock.connect(where)
            break
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    else:
        raise PeerError(f"cannot reach holder at {address}: {error}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def describe(address: str, token: str, model: str, version: int, timeout: float,
             source: Optional[str] = None) -> Described:
    """Ask the holder at ``address`` where its chunks of ``model@version`` live.
    ``timeout`` (seconds; no default: the caller's budget) bounds the connect and each
    send and receive. Raises ``PeerError`` on refusal, silence or a bad answer."""
    with dial(address, timeout, source) as sock:
        try:
            sock.sendall(frame(Ask(v=WIRE_VERSION, token=token, op=Describe(model=model, version=version))))
            body = recv_answer(sock).body
        except OSError as exc:
            raise PeerError(f"holder at {address} did not answer describe: {exc}") from None
    if isinstance(body, Refused):
        raise PeerError(f"holder at {address} refused describe of {model}@{version}: {body.code}: {body.message}")
    if not isinstance(body, Described):
        raise PeerError(f"holder at {address} answered describe with {type(body).__name__}")
    return body


# How much longer than the await itself the reader's socket waits: the holder's answer
# travels after its wait ends, and its thread may be busy serving reads meanwhile.
AWAIT_MARGIN_S = 5.0


def await_chunks(address: str, token: str, model: str, version: int, mask: int, timeout: float,
                 source: Optional[str] = None, kept: Optional["Kept"] = None) -> int:
    """Wait (up to ``timeout`` seconds, which the holder may cap) until the holder at
    ``address`` holds at least one chunk of ``mask`` (global chunk ids as bits) of
    ``model@version``; returns those of ``mask`` it holds then (0: none within the wait).
    The connect, the send and the answer's receive each give up after ``timeout`` +
    ``AWAIT_MARGIN_S``. Raises ``ValueError`` naming a bad ``mask`` or ``timeout``, and
    ``PeerError`` on refusal (``not_found``: the holder does not hold that version, or
    dropped it while we waited), silence or a bad answer. ``kept``: ask on that kept
    connection to ``address`` (``Kept``) instead of a connection of its own. With
    ``after`` (fragments, see the module), use ``await_fragments``."""
    return _await(address, token, model, version, mask, timeout, source, None, kept)[0]


def await_fragments(address: str, token: str, model: str, version: int, mask: int, timeout: float,
                    source: Optional[str], after: dict[int, int],
                    kept: Optional["Kept"] = None) -> tuple[int, dict[int, int]]:
    """``await_chunks`` that also ends when a chunk of ``after`` has more bytes landed at
    the holder than named there: (chunks held, {chunk: bytes landed} for chunks of
    ``mask`` not held)."""
    return _await(address, token, model, version, mask, timeout, source, after, kept)


class Kept:
    """One connection to a holder, kept between asks made one at a time: a reader's
    ``Await``s on one source (one outstanding per source), so a notice costs a round trip,
    not a connect and an accept as well (about a quarter of the CPU on loopback). Not for
    two threads at once, but for ``abort``. A kept connection the holder closed while it
    sat idle (``endpoint.peer.IDLE_S``) is dialed again once, for an ask that is safe to
    repeat; a timeout is not retried. ``close()`` once done; an ask after it dials again."""

    def __init__(self, address: str, source: Optional[str] = None):
        self.address, self.source = address, source
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()  # (``_sock`` and ``_aborted`` against ``abort``)
        self._aborted = False

    def exchange(self, ask: Ask, timeout: float) -> Answer:
        """Send ``ask``, return its answer; each connect, send and receive gives up after
        ``timeout`` seconds. Raises ``PeerError`` (or ``OSError``) as ``dial`` and
        ``recv_answer`` do, and ``PeerError`` once ``abort`` was called."""
        payload = frame(ask)
        while True:
            with self._lock:
                sock = self._sock
            fresh = sock is None
            if fresh:
                try:
                    sock = dial(self.address, timeout, self.source, claim=self._claim)
                except PeerError:
                    with self._lock:
                        self._sock = None  # (a socket ``_claim`` kept, closed by ``dial``)
                    if self._aborted:
                        raise self._off() from None
                    raise
            sock.settimeout(timeout)
            try:
                sock.sendall(payload)
                return recv_answer(sock)
            except (OSError, PeerError) as exc:
                self.close()
                if self._aborted:
                    raise self._off() from None
                if fresh or isinstance(exc, TimeoutError):
                    raise

    def _claim(self, sock: socket.socket) -> None:
        with self._lock:
            if self._aborted:
                raise self._off()
            self._sock = sock

    def _off(self) -> PeerError:
        return PeerError(f"holder at {self.address}: the ask was called off")

    def abort(self) -> None:
        """From any thread: end the ask in progress (its connect included) at once and
        every later one (each raises ``PeerError``). Once it returns, the thread asking
        holds no wait at the holder beyond its next wake-up; it closes the connection."""
        with self._lock:  # (held across the shutdown: ``close`` cannot free the fd meanwhile)
            self._aborted = True
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # (wakes a blocked recv; close stays the asker's)
                except OSError:
                    pass  # (not connected yet, or already closed)

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            if sock is not None:
                sock.close()


class KeptByHolder:
    """A ``Kept`` connection per holder name, for a caller that asks each holder one thing
    at a time (the scheduled fetch's ``Await``s: one out per source). ``take`` hands one
    out (kept, or new when none is kept or the holder's address changed), ``put`` keeps it
    again, ``drop`` closes one whose ask failed, ``close`` closes those kept and aborts those out (``Kept.abort``: a wait on a
    holder that went silent ends now, not at its timeout), and any taken after it comes
    out aborted. Thread-safe."""

    def __init__(self, source: Optional[str] = None):
        self._source = source
        self._lock = threading.Lock()
        self._kept: Optional[dict[str, Kept]] = {}
        self._out: set[Kept] = set()

    def take(self, name: str, address: str) -> Kept:
        with self._lock:
            kept = self._kept.pop(name, None) if self._kept is not None else None
            if kept is not None and kept.address != address:
                kept.close()  # (the holder registered again elsewhere)
                kept = None
            if kept is None:
                kept = Kept(address, self._source)
            if self._kept is None:
                kept.abort()
            else:
                self._out.add(kept)
            return kept

    def put(self, name: str, kept: Kept) -> None:
        with self._lock:
            self._out.discard(kept)
            if self._kept is not None:
                self._kept[name] = kept
                return
        kept.close()  # (closed while this one was out)

    def drop(self, kept: Kept) -> None:
        """A connection given up (its ask failed): closed, and no longer out."""
        with self._lock:
            self._out.discard(kept)
        kept.close()

    def close(self) -> None:
        with self._lock:
            kept, self._kept = self._kept or {}, None
            out, self._out = self._out, set()
        for k in kept.values():
            k.close()
        for k in out:
            k.abort()


def _await(address: str, token: str, model: str, version: int, mask: int, timeout: float,
           source: Optional[str], after: Optional[dict[int, int]],
           kept: Optional[Kept] = None) -> tuple[int, dict[int, int]]:
    if not isinstance(mask, int) or mask <= 0:
        raise ValueError(f"await_chunks: mask must name at least one chunk (a positive int), not {mask!r}")
    if not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"await_chunks: timeout must be a finite number of seconds >= 0, not {timeout!r}")
    ask = Await(model=model, version=version, chunks=mask_bytes(mask), timeout_s=float(timeout), after=after)
    conn = kept if kept is not None else Kept(address, source)
    try:
        body = conn.exchange(Ask(v=WIRE_VERSION, token=token, op=ask), timeout + AWAIT_MARGIN_S).body
    except OSError as exc:
        raise PeerError(f"holder at {address} did not answer await of {model}@{version} "
                        f"within {timeout + AWAIT_MARGIN_S:g}s: {exc}") from None
    finally:
        if kept is None:
            conn.close()
    if isinstance(body, Refused):
        raise PeerError(f"holder at {address} refused await of {model}@{version}: {body.code}: {body.message}")
    if not isinstance(body, Have):
        raise PeerError(f"holder at {address} answered await with {type(body).__name__}")
    have = mask_int(body.chunks)
    if have & ~mask:
        raise PeerError(f"holder at {address} answered await of {model}@{version} with chunks not asked")
    if any(not mask >> c & 1 or have >> c & 1 for c in body.landed):
        raise PeerError(f"holder at {address} answered await of {model}@{version} with landed bytes of "
                        f"chunks not asked or held")
    return have, body.landed


def read_delta(address: str, token: str, model: str, version: int, base: int, index: int, nbytes: int,
               timeout: float, source: Optional[str] = None) -> tuple[bytearray, bool]:
    """Chunk ``index`` of ``model@version`` from the holder at ``address`` as a delta
    against ``model@base`` (``ReadDelta``): ``(payload, full)``, ``full`` when the holder
    sent the chunk itself. ``nbytes``: the chunk's size, a payload's ceiling. ``timeout``
    bounds the connect and each send and receive. Raises ``PeerError`` on refusal,
    silence, or an answer that does not fit the chunk."""
    ask = ReadDelta(model=model, version=version, base=base, index=index)
    with dial(address, timeout, source) as sock:
        try:
            sock.sendall(frame(Ask(v=WIRE_VERSION, token=token, op=ask)))
            body = recv_answer(sock).body
            if isinstance(body, Refused):
                raise PeerError(f"holder at {address} refused a delta of {model}@{version} chunk {index} "
                                f"against @{base}: {body.code}: {body.message}")
            if not isinstance(body, DeltaBytes):
                raise PeerError(f"holder at {address} answered a delta ask with {type(body).__name__}")
            if body.nbytes > nbytes or (body.full and body.nbytes != nbytes):
                raise PeerError(f"holder at {address} sent {body.nbytes} bytes for a delta of a "
                                f"{nbytes}-byte chunk (full={body.full})")
            payload = bytearray(body.nbytes)
            recv_exact(sock, memoryview(payload))
        except OSError as exc:
            raise PeerError(f"holder at {address} did not answer a delta of {model}@{version}: {exc}") from None
    return payload, body.full
