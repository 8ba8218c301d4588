"""Plans, progress and cancels: a reader's reads, and what the hub counts of them.

``plan`` asks the planner which holders serve which of the reader's missing chunks
and pins each planned read on its source (contract 3: a pinned source's drain waits
for it). A ``Plan`` may carry the reader's progress since its last one, so a fetch is
one round trip per cycle. ``progress`` turns verified chunks into held ones (the
reader is a holder of them from then on) and failed reads into re-plans elsewhere
(contract 5); chunks read in part by a reader of another layout (``tiled``) become
its tiles in ``Version.layouts``, planned to readers of that same layout only
(``Reader.extra``) and never waited on as relays (quiet pins); ``cancel`` drops a reader's reads in flight. Reads onto a source that
stopped heartbeating are dropped at the reader's next plan (contract 6).
"""

from __future__ import annotations

import zlib
from operator import attrgetter

from ..planner import LEVELS, REMOTE, Limits, PlanResult, Reader, Sources, Walk, choose, may_cross
from . import protocol as p
from . import mustering, scheduling
from .deltas import Bases
from .draining import drop_old, settle
from .faults import HubFault
from .publishing import index
from .registry import READY, Replica, Version, bits
from .resolving import require_ready
from .state import Endpoint, HubState

_LEVEL_KEYS = [f"bytes_planned.level.{name}" for name in LEVELS]
_TIER_KEYS = {tier: f"bytes_planned.tier.{tier}" for tier in ("device", "host")}
# A trainer's send counter, split by its readers' kind: spot joiners should read ~0 of it.
_FROM_PUBLISHERS = {True: "bytes_planned.from_publishers.reliable", False: "bytes_planned.from_publishers.spot"}


def plan(hub: HubState, now: float, op: p.Plan) -> p.Planned | None:
    """None: a first scheduled plan parked in its swarm's muster (``mustering``)."""
    reader = hub.endpoint(op.name, op.incarnation)
    if op.chunks or op.held or op.failed or op.tiled:
        progress(hub, now, p.Progress(name=op.name, model=op.model, version=op.version, chunks=op.chunks,
                                      failed=op.failed, tiled=op.tiled, layout=op.layout, held=op.held))
    v = hub.version(op.model, op.version)
    require_ready(v, now < hub.grace_until)
    if op.name in v.draining:
        # Its buffer is being let go: reads into it would be lost, and their pins
        # would outlive the replica they were filling.
        raise HubFault("draining", f"{op.name} is unpublishing {v.model}@{v.number}; "
                                   "it cannot fetch that version until the unpublish is acknowledged")
    rep = v.replicas.get(op.name)
    want = int.from_bytes(op.want, "little") & v.full if op.want else v.full
    scheduled = op.schedule and not op.layout and op.name not in v.pulls
    if rep is None and scheduled and mustering.park(hub, now, v, op, reader.place.dc, want):
        return None  # (not a holder yet: nothing to drain, nothing pinned)
    if rep is None:  # a reader is a (partial) holder from its first plan on
        rep = v.replicas[op.name] = Replica(endpoint=op.name)
    if rep.held & want == want:
        rep.satisfied = True
        return p.Planned(reads=[], sources=[], complete=True)
    _drop_lost_reads(hub, now, v, op.name)
    assigned, mine = 0, {}
    for source, chunks in v.feeds.get(op.name, {}).items():
        assigned |= chunks
        mine[source] = chunks.bit_count()
    window = max(1, min(op.window, hub.config.max_window))
    needed = want & ~rep.held & ~assigned
    limit = window - assigned.bit_count()
    crossing = _may_cross(v, reader)  # (also when nothing is planned: it hands a stalled seed's role on)
    if scheduled:
        result = scheduling.assign(hub, now, v, reader, want, want & ~rep.held & ~assigned)
    elif limit > 0 and needed:  # (a full window, the common reply to a report, plans nothing)
        walk = Walk(
            Reader(reader.name, reader.place, needed, mine, v.avoid.get(reader.name, ()), reader.name in v.pulls,
                   v.layouts.get(op.layout, {}) if op.layout else {}),
            Sources(v.replicas, v.publishers, v.draining, hub.endpoints, v.near, hub.near, hub.load, hub.full,
                    {}, v.spread, v.sending, v.holding),
            Limits(now, hub.config.expiry_s, hub.config.max_reads_per_source, hub.config.planner == "star"),
            hub.asking,
        )
        result = choose(needed=needed, start=zlib.crc32(op.name.encode()) % v.nchunks, limit=limit,
                        levels=walk.levels(crossing), may_cross=crossing, deferred=walk.deferred)
    else:
        result = PlanResult()
    # A reader of another layout may hold none of these chunks whole: nobody waits for it to relay them.
    _account(hub, now, v, reader, result, relays=not op.layout)
    if result.crossed:
        # One seed per DC for windowed plans; every crossing, scheduled or not, feeds
        # the DC's scheduled readers (``Swarms.feeders``): a chunk crosses once.
        v.seeds[reader.place.dc] = op.name
        if not scheduled:
            v.swarms.crossed(reader.place.dc, op.name, result.chunks(REMOTE))
    hub.count("plans")
    # Reads restored after a hub restart whose source has not re-registered stay
    # pinned but unlisted: the reader finishes or fails them on its own.
    feeds = {s: chunks for s, chunks in v.feeds.get(op.name, {}).items() if s in hub.endpoints}
    listed = _listed(hub, v, op, feeds)
    return p.Planned(
        # (a schedule's reads a source at a time: the hub's work per plan is per source)
        reads=[] if scheduled else sorted((r for feed in listed for r in feed.reads()), key=_CHUNK),
        feeds=[feed.wire() for feed in listed] if scheduled else [],
        sources=[_source(hub, n) for n in sorted(feeds)],
        waiting=result.waiting,
        first=v.swarms.first(op.name) if scheduled else 0,
        serial=scheduled and v.swarms.serial(op.name),
    )


def _listed(hub: HubState, v: Version, op: p.Plan, feeds: dict[str, int]) -> list[p.Feed]:
    """Every read outstanding for the reader (``feeds``: source -> chunks), a source at
    a time: which of its chunks the source holds now (``ready``: whole, or as tiles of
    any layout; a source the hub has no replica of, restored after a restart, counts as
    ready), which are planned onto the source's tiles of the reader's layout
    (``tiled``), and the delta ``base`` of each that has one."""
    base = Bases(hub, v, op.name)
    out = []
    for s, chunks in feeds.items():
        rep = v.replicas.get(s)
        if rep is None:
            ready, tiles, dear = chunks, 0, False
        else:
            ready = rep.held
            for t in v.layouts.values():
                ready |= t.get(s, 0)
            tiles = v.layouts.get(op.layout, {}).get(s, 0) & ~rep.held if op.layout else 0
            dear = not op.layout and base.dear(s)
        bases = [(c, b) for c in bits(chunks) if (b := base(s, c)) >= 0] if dear else []
        out.append(_Feed(s, chunks, ready & chunks, tiles & chunks, bases))
    return out


_CHUNK = attrgetter("chunk")


class _Feed:
    """A source's reads as the hub works them out; ``wire`` for a scheduled plan (a
    ``Feed``, chunk bitsets), ``reads`` for a windowed one (``Read`` by ``Read``)."""

    __slots__ = ("source", "chunks", "ready", "tiled", "bases")

    def __init__(self, source: str, chunks: int, ready: int, tiled: int, bases: list[tuple[int, int]]):
        self.source, self.chunks, self.ready, self.tiled, self.bases = source, chunks, ready, tiled, bases

    def wire(self) -> p.Feed:
        return p.Feed(source=self.source, chunks=p.bitset(self.chunks),
                      ready=p.bitset(self.ready) if self.ready else b"", bases=self.bases)

    def reads(self) -> list[p.Read]:
        bases, s, ready, tiled = dict(self.bases), self.source, self.ready, self.tiled
        return [p.Read(chunk=c, source=s, tiled=bool(tiled >> c & 1), ready=bool(ready >> c & 1),
                       base=bases.get(c, -1)) for c in bits(self.chunks)]


def _may_cross(v: Version, reader: Endpoint) -> bool:
    """Contract 8 through ``planner.may_cross``; an inactive seed is dropped here."""
    seed = v.seeds.get(reader.place.dc)
    active = seed is not None and seed in v.replicas and seed not in v.draining and bool(v.feeds.get(seed))
    if seed is not None and seed != reader.name and not active:
        del v.seeds[reader.place.dc]
    return may_cross(seed, reader.name, active)


def _account(hub: HubState, now: float, v: Version, reader: Endpoint, result: PlanResult,
             relays: bool = True) -> None:
    """Pin the planned reads (a source at a time) and count their bytes by level,
    tier and publisher."""
    if not result.assigned and not result.fed:
        return
    by = result.by_source()
    planned: dict[str, int] = {}  # counter -> bytes, summed here so each counter is touched once
    relayed = 0  # reads served by readers, not publishers: pipelined replication at work
    name = reader.name
    for (source, level), chunks in by.items():
        hub.pin(v, name, source, chunks, relays)
        nbytes = v.bytes_of(chunks)
        reader.bytes_planned += nbytes
        if v.replicas[source].rank >= 0:
            hub.asking.note(source, name, now)
            reader.bytes_from_publishers += nbytes
            tier = _FROM_PUBLISHERS[reader.info.reliable]
            planned[tier] = planned.get(tier, 0) + nbytes
        else:
            relayed += chunks.bit_count()
        for key in (_LEVEL_KEYS[level], _TIER_KEYS[hub.endpoints[source].info.tier]):
            planned[key] = planned.get(key, 0) + nbytes
    for key, nbytes in planned.items():
        hub.count(key, nbytes)
    if relayed:
        hub.count("reads_from_readers", relayed)


def _drop_lost_reads(hub: HubState, now: float, v: Version, reader: str) -> None:
    """Contract 6: reads onto a source past its expiry (swept or not) are re-planned
    at once. A source that has not re-registered since a hub restart counts as lost
    only after the grace period."""
    for source, chunks in list(v.feeds.get(reader, {}).items()):
        if source in hub.endpoints:
            lost = not hub.alive(now, source)
        else:
            lost = now >= hub.grace_until
        if lost:
            hub.unpin(v, reader, chunks)


def _source(hub: HubState, name: str) -> p.Source:
    info = hub.endpoints[name].info
    return p.Source(name=name, node=info.node, engine=info.engine, engine_meta=info.engine_meta)


def progress(hub: HubState, now: float, op: p.Progress) -> p.Ok:
    hub.endpoint(op.name, op.incarnation)
    v = hub.version(op.model, op.version)
    if not v.assembled:
        raise HubFault("not_ready", f"{v.model}@{v.number} is {v.state}")
    done, tiled = _ids(v, op.chunks) | _held(v, op.held), _ids(v, op.tiled)
    if done:  # (only failures: no replica is made for them, e.g. after an unpublish)
        rep = v.replicas.setdefault(op.name, Replica(endpoint=op.name))
        before = rep.held
        rep.held |= done
        hub.unpin(v, op.name, done)
        if rep.rank < 0:
            v.respread(rep.held & ~before, hub.endpoints[op.name].place.dc)
        if rep.held == v.full:
            hub.asking.done(op.name)
        index(hub, v, op.name)
    if op.tiled:  # read in part (another layout): its tiles serve readers of that layout only
        v.replicas.setdefault(op.name, Replica(endpoint=op.name))
        tiles = v.layouts.setdefault(op.layout, {})
        tiles[op.name] = tiles.get(op.name, 0) | tiled
        hub.unpin(v, op.name, tiled)
        index(hub, v, op.name)
    for r in op.failed:  # contract 5: a corrupt or failed read is re-planned elsewhere
        if 0 <= r.chunk < v.nchunks and v.source_of(op.name, r.chunk) == r.source:
            hub.unpin(v, op.name, 1 << r.chunk)
            v.avoid.setdefault(op.name, set()).add(r.source)
            v.swarms.unfeed(hub.endpoints[op.name].place.dc, r.chunk, r.source)
            hub.count("reads_failed")
    hub.count("chunks_reported", done.bit_count())
    was = v.state
    if was != READY and v.refresh() == READY:  # adding chunks cannot uncover a READY version
        hub.event(now, "ready", op.name, v.model, v.number)
        drop_old(hub, v.model)
        settle(hub, now)
    elif v.pulls or v.draining:
        settle(hub, now, v)
    return p.Ok()


def _ids(v: Version, chunks: list[int]) -> int:
    """A report's chunk ids as a bitset, or a ``malformed`` fault naming those out of range."""
    try:
        mask = p.mask_of(chunks)
    except ValueError:  # (a negative id: a negative shift)
        mask = -1
    if mask < 0 or mask >> v.nchunks:
        bad = [c for c in chunks if not 0 <= c < v.nchunks]
        raise HubFault("malformed", f"chunk ids out of range 0..{v.nchunks - 1}: {bad[:8]}")
    return mask


def _held(v: Version, data: bytes) -> int:
    """A report's bitset (``Plan.held``), or a ``malformed`` fault naming a chunk past the version's last."""
    mask = int.from_bytes(data, "little")
    if mask >> v.nchunks:
        bad = p.unbits((mask >> v.nchunks << v.nchunks).to_bytes(len(data), "little"))
        raise HubFault("malformed", f"chunk ids out of range 0..{v.nchunks - 1}: {bad[:8]}")
    return mask


def cancel(hub: HubState, now: float, op: p.Cancel) -> p.Ok:
    """The reader gave up its reads in flight (a fetch timed out or was aborted)."""
    hub.endpoint(op.name, op.incarnation)
    v = hub.version(op.model, op.version)
    hub.unpin(v, op.name, -1)
    hub.asking.done(op.name)
    settle(hub, now)
    return p.Ok()
