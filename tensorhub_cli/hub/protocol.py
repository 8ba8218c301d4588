"""The hub's wire protocol: msgspec Structs over ZeroMQ, one message type per operation.

Framing. A client (DEALER) sends one frame: a msgpack ``Request`` envelope carrying the
protocol version ``v``, the cluster ``token``, a request id ``rid`` chosen by the client,
and exactly one operation body. The hub (ROUTER) answers each request with one
``Reply`` carrying the same ``rid``; a reply may come later than other replies
(``Unpublish`` is acknowledged only after its drain, ``Withdraw`` once its replicas
are gone). The hub may also push ``Reply`` frames with ``rid == 0`` to an endpoint
(a ``Command``, e.g. a retention pull).

Rules. A frame larger than ``MAX_FRAME`` bytes, one that does not decode, one with a
foreign ``v`` or a token that does not match is answered with an ``Error`` and counted;
it never changes hub state. Bodies are tagged unions, so adding an operation is adding
a Struct; changing a field's meaning is a new protocol version.
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from typing import Literal, Optional, Union

import msgspec

from .msg import Msg
# The operator's messages live apart (``operator_wire``); they are part of this protocol,
# named here as ever (``p.Status``, ``p.Command``...).
from .operator_wire import (Command, EndpointStatus, Event, Events, EventsReply, HolderStatus, Load, Note,  # noqa: F401
                            Report, Status, StatusReply, Sync, Synced, VersionStatus, Versions, VersionsReply,
                            Withdraw, Withdrawn)

PROTOCOL_VERSION = 3  # 2: a scheduled plan is answered in ``Planned.feeds``; 3: reports as bitsets (``held``)
# A 10k-tensor manifest is ~1 MiB; a large MoE's (~91k tensors) ~12 MiB, and a reader
# re-registering after a hub restart sends every shard's. Bigger is a bug or an attack.
MAX_FRAME = 64 << 20


# --- data carried by operations ------------------------------------------------------


class TensorMeta(Msg):
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    offset: int  # byte offset in the shard's flat layout; chunks are slices of that layout
    # Layouts (contract 9): this piece is the box of a global tensor of ``global_shape``
    # that starts at ``box_offsets`` (its sizes are ``shape``). Both empty: the whole
    # tensor (omitted on the wire, so whole-tensor manifests encode as before).
    global_shape: list[int] = []
    box_offsets: list[int] = []


class ChunkMeta(Msg):
    nbytes: int
    checksum: int  # the chunk's bytes hashed with ``digest`` (an unsigned 64-bit int)
    # Which digest ``checksum`` is (layout/checksum.py): "xxh3" (XXH3-64, host memory) or
    # "dev64" (computed with torch ops on the publisher's GPU; a reader recomputes it on
    # its own device, CPU included). The default is omitted on the wire, so host-published
    # manifests encode as before and manifests from before this field decode as xxh3.
    digest: Literal["xxh3", "dev64"] = "xxh3"
    # Tiles: a chunk inside one tensor covers whole rows of it (the last dimension is a
    # row); it is also hashed as tiles of ``tile_rows`` rows by ``strips`` equal column
    # strips, row block by row block (``tiles[b * strips + k]``), so a reader of another
    # layout verifies the tiles it reads, never the whole chunk (layout/chunking.py).
    # Empty: the chunk is verified whole.
    tile_rows: int = 0
    strips: int = 0
    tiles: list[int] = []


class Manifest(Msg):
    """One shard's tensors and the chunks its flat layout is cut into."""

    tensors: list[TensorMeta]
    chunks: list[ChunkMeta]
    chunk_bytes: int


class EndpointInfo(Msg):
    name: str
    node: str
    dc: str = ""
    rack: str = ""
    role: str = ""
    kind: Literal["endpoint", "agent"] = "endpoint"
    reliable: bool = True
    tier: Literal["device", "host"] = "host"
    group: Optional[str] = None
    engine: str = "tcp"
    engine_meta: bytes = b""  # what a peer needs to read from us (NIXL agent metadata, host:port)
    pid: int = 0
    # One endpoint process's life (a random id per ``Endpoint``). Re-registering with
    # the incarnation the hub knows keeps every pin and pending unpublish (a slow
    # heartbeat, not a restart); another incarnation replaces the old one, and ops
    # carrying the old one are refused ``fenced`` (contract 3: a dead reader's reads
    # can neither be resurrected nor completed). "" (an old client): not checked.
    incarnation: str = ""


class Read(Msg):
    chunk: int
    source: str
    # The source holds only the tiles of this chunk a reader of its own layout needs
    # (``Plan.layout``): read its staged tiles as they lie, not the chunk.
    tiled: bool = False
    # A scheduled read (``Plan.schedule``) whose source will hold the chunk but does
    # not yet: wait for the source's notice (``wire.Await``), then read.
    ready: bool = True
    # >= 0: ask the source for the chunk as a delta against this older version, whose
    # chunk both ends hold (``hub.deltas``, ``wire.ReadDelta``); -1: the chunk itself.
    base: int = -1


class Holding(Msg):
    """What an endpoint holds of one version, sent again after a hub restart."""

    model: str
    version: int
    world: int
    shards: list[Manifest]  # for a publisher: only its own shard, at index 0
    rank: int = -1  # >= 0: a publisher's shard; -1: a reader's (full manifest) replica
    held: list[int] = []  # global chunk ids (readers); publishers hold their whole shard
    reading: list[Read] = []  # reads in flight, so the rebuilt hub pins their sources again
    # Chunks held in part (a reader of another layout: ``Plan.tiled``) and that layout,
    # so a rebuilt hub serves those tiles to readers of the same layout again.
    tiled: list[int] = []
    layout: str = ""


# --- operations ----------------------------------------------------------------------


class Register(Msg, tag="register"):
    info: EndpointInfo
    holdings: list[Holding] = []


class Filling(Msg):
    """A reader's progress on a replica it is filling, for operators to watch: the
    chunks it has verified so far, as a bitset (``Plan.held``). Carried by its beats;
    the hub shows it (``HolderStatus.held_bytes``) and plans nothing from it: a chunk is
    served from a reader once its report (``Plan.held``) says so."""

    model: str
    version: int
    held: bytes = b""


class Heartbeat(Msg, tag="heartbeat"):
    name: str
    incarnation: str = ""
    filling: list[Filling] = []  # the replicas it is filling, while a fetch runs


class Deregister(Msg, tag="deregister"):
    name: str
    incarnation: str = ""  # a replaced process's Deregister must not drop its successor


class Publish(Msg, tag="publish"):
    name: str
    model: str
    version: int
    manifest: Manifest
    rank: int = 0
    world: int = 1
    incarnation: str = ""


class Resolve(Msg, tag="resolve"):
    name: str
    model: str
    version: Optional[int] = None  # None: latest READY
    group: Optional[str] = None
    # Versions the caller holds, by number, with their ``manifest_digest``: when the
    # answer is one of them the hub leaves ``Resolved.shards`` empty (the caller has
    # them). A reader asking for ``latest`` again and again (a rollout waiting for the
    # next version) then costs bytes, not a manifest per ask.
    known: dict[int, int] = {}


class Plan(Msg, tag="plan"):
    """Assign reads; ``chunks``/``failed`` first apply a ``Progress`` (one round trip
    per cycle of the reader's loop instead of two)."""

    name: str
    model: str
    version: int
    window: int = 32
    chunks: list[int] = []
    failed: list[Read] = []
    incarnation: str = ""
    # Plan only these chunks (a little-endian bitmask of chunk ids; a collective
    # member's stripe, endpoint/collective.py); ``complete`` once they are held.
    # Empty: every chunk.
    want: bytes = b""
    # Chunks read and verified only in part (a reader of another layout needs a box of
    # them): unpinned at their source, and served only to readers of our ``layout``
    # (a hash of our boxes, layout.boxes.layout_id; "": the publisher's layout, whole
    # chunks), which need exactly those tiles.
    tiled: list[int] = []
    layout: str = ""
    # A schedule, not a window: a read for every chunk still needed, from holders that
    # may not hold it yet (``Read.ready``); asked again only with progress or failures
    # (hub/scheduling.py). Ignored for readers of another layout and retention pulls.
    schedule: bool = False
    # ``chunks`` as a bitset (``bitset``): what a scheduled reader sends, so the hub's
    # work per report is per report, not per chunk. Either or both may be given.
    held: bytes = b""


class Progress(Msg, tag="progress"):
    name: str
    model: str
    version: int
    chunks: list[int]  # verified (checksum matched): the reader now holds them
    failed: list[Read] = []  # reads that failed or arrived corrupt: unpinned, source avoided
    incarnation: str = ""
    tiled: list[int] = []  # read in part only (``Plan.tiled``): unpinned, not held
    layout: str = ""
    held: bytes = b""  # more verified chunks, as a bitset (``Plan.held``)


class Cancel(Msg, tag="cancel"):
    """Release every read in flight of ``name`` on this version. Send it only once those
    transfers have stopped: the pins it releases are what holds a source's drain back."""

    name: str
    model: str
    version: int
    incarnation: str = ""


class Unpublish(Msg, tag="unpublish"):
    name: str
    model: str
    version: int
    incarnation: str = ""


Op = Union[Register, Heartbeat, Deregister, Publish, Resolve, Plan, Progress, Cancel, Unpublish, Status, Versions,
           Sync, Load, Report, Note, Events, Withdraw]


class Request(Msg):
    v: int
    token: str
    rid: int
    op: Op


# --- replies -------------------------------------------------------------------------


class Error(Msg, tag="error"):
    # auth, malformed, too_large, version, internal (refused by the service); unknown_endpoint,
    # conflict, not_found, not_ready, unavailable, draining, bad_request, stale (refused by the hub's
    # state machine); timeout (a deferred answer: a Withdraw not done within its timeout_s)
    code: str
    message: str
    missing: list[int] = []  # for code == "unavailable": chunk ids no live endpoint holds


class Ok(Msg, tag="ok"):
    pass


class Resolved(Msg, tag="resolved"):
    model: str
    version: int
    world: int
    shards: list[Manifest]  # empty when ``Resolve.known`` named this very version
    round: int = 0


class Source(Msg):
    name: str
    node: str
    engine: str
    engine_meta: bytes


def bitset(mask: int) -> bytes:
    """Chunk ids as a bitset on the wire: little-endian bytes, bit i = chunk i."""
    return mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "little")


def mask_of(chunks) -> int:
    """The bitset of the chunk ids ``chunks``, as an int (``bitset`` puts it on the wire;
    one C-level pass, not a Python step per chunk). A negative id raises ValueError."""
    return reduce(or_, map(_ONE.__lshift__, chunks), 0)


_ONE = 1


def unbits(data: bytes) -> list[int]:
    mask, out = int.from_bytes(data, "little"), []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class Feed(Msg):
    """One source's reads for a scheduled reader, as bitsets (``bitset``): the hub
    answers a schedule a source at a time, so what it does per plan grows with the
    reader's sources (a few), not with their chunks (a slice's many)."""

    source: str
    chunks: bytes
    ready: bytes = b""  # of ``chunks``, those the source holds now (``Read.ready``)
    bases: list[tuple[int, int]] = []  # (chunk, base): those to ask for as deltas (``Read.base``)

    def reads(self) -> list[Read]:
        ready, bases, s = int.from_bytes(self.ready, "little"), dict(self.bases), self.source
        return [Read(chunk=c, source=s, ready=bool(ready >> c & 1), base=bases.get(c, -1))
                for c in unbits(self.chunks)]


class Planned(Msg, tag="planned"):
    # Every read outstanding for this reader, old and new: one by one (``reads``), or
    # for a scheduled plan (``Plan.schedule``) a source at a time (``feeds``).
    reads: list[Read]
    sources: list[Source]  # the endpoints those reads name
    waiting: int = 0  # chunks held only beyond a DC link whose seed is still filling
    complete: bool = False  # the reader already holds every chunk (every wanted one)
    # Read from this chunk on, ascending, wrapping round: a schedule's chains side by
    # side start at different publishers; a chain's members share it (0: from the lowest).
    first: int = 0
    serial: bool = False  # one read at a time: the reader heads a chain (``Swarms.serial``)
    feeds: list[Feed] = []

    def listed(self) -> list[Read]:
        """Every outstanding read, one by one, by chunk."""
        if not self.feeds:
            return self.reads
        out = list(self.reads)
        for feed in self.feeds:
            out += feed.reads()
        out.sort(key=lambda r: r.chunk)
        return out


Body = Union[Error, Ok, Resolved, Planned, Command, Synced, StatusReply, VersionsReply, EventsReply, Withdrawn]


class Reply(Msg):
    v: int
    rid: int
    body: Body


class _ResolvedShards(Msg, tag="resolved"):
    """``Resolved`` with its manifests already encoded: the same bytes on the wire (a
    Struct encodes as a map of its fields in order; ``Raw`` is spliced in as it is)."""

    model: str
    version: int
    world: int
    shards: msgspec.Raw
    round: int = 0


class _ResolvedReply(msgspec.Struct):
    v: int
    rid: int
    body: _ResolvedShards


_req_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_rep_dec = msgspec.msgpack.Decoder(Reply)


def encode(msg: Request | Reply) -> bytes:
    return _req_enc.encode(msg)


def encode_shards(shards: list[Manifest]) -> msgspec.Raw:
    """A version's manifests encoded once, for every ``resolved_reply`` of it."""
    return msgspec.Raw(_req_enc.encode(shards))


def resolved_reply(rid: int, body: Resolved, shards: msgspec.Raw) -> bytes:
    """``encode(Reply(v=PROTOCOL_VERSION, rid=rid, body=body))``, byte for byte, with
    ``body.shards`` taken as ``shards`` (``encode_shards(body.shards)``) as it is."""
    return _req_enc.encode(_ResolvedReply(v=PROTOCOL_VERSION, rid=rid, body=_ResolvedShards(
        model=body.model, version=body.version, world=body.world, shards=shards, round=body.round)))


def decode_request(frame: bytes) -> Request:
    return _req_dec.decode(frame)


def decode_reply(frame: bytes) -> Reply:
    return _rep_dec.decode(frame)


def manifest_digest(world: int, shards: list[Manifest]) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(_req_enc.encode([world, shards]))
