"""The peer channel: what a reader asks a holder directly, over TCP.

Framing: a 4-byte big-endian length, then a msgpack ``Ask`` (or ``Answer``). Every ask
carries the cluster token, compared in constant time; a frame over ``MAX_ASK`` or with
a bad token is answered ``Refused`` and the connection closed. Two asks exist:

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
"""

from __future__ import annotations

import socket
import struct
from typing import Optional, Union

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


class Ask(msgspec.Struct):
    v: int
    token: str
    op: Union[Describe, ReadRanges, ReadBytes]


class Described(msgspec.Struct, tag="described"):
    engine: str
    description: bytes
    rank: int  # >= 0: addrs are that shard's chunks; -1: every global chunk
    addrs: list[int]
    device: int = -1  # the holder's memory: -1 host, N CUDA device N (a read names it as remote_device)


class Bytes(msgspec.Struct, tag="bytes"):
    nbytes: int


class Refused(msgspec.Struct, tag="refused"):
    code: str
    message: str


class Answer(msgspec.Struct):
    body: Union[Described, Bytes, Refused]


_enc = msgspec.msgpack.Encoder()
_ask = msgspec.msgpack.Decoder(Ask)
_answer = msgspec.msgpack.Decoder(Answer)


class PeerError(Exception):
    pass


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


def dial(address: str, timeout: float, source: Optional[str] = None) -> socket.socket:
    """A connection to ``address`` whose connect and every later send and receive
    give up after ``timeout`` seconds (``socket.timeout``, an ``OSError``)."""
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout,
                                        source_address=(source, 0) if source else None)
    except OSError as exc:
        raise PeerError(f"cannot reach holder at {address}: {exc}") from None
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
