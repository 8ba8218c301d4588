"""Publishing shards, assembling versions, and restoring holdings (contracts 1 and 7).

A version is published shard by shard (``rank`` of ``world``). Once every rank's
manifest is in it is *assembled* (``Version.assemble``): each publisher then holds its
shard's chunk range, and the version is READY once live holders cover every chunk.
``restore`` rebuilds a version from a re-registering endpoint's holding after a hub
restart: its replica, and its reads in flight as pins, so a drain cannot be judged
complete before every live reader has told the hub what it is reading.

A ``Publish`` whose model name does not match ``names.MODEL_PATTERN`` is refused
``bad_request``, and one adding to a version an operator is withdrawing ``conflict``.
One the hub would not keep is refused ``stale``: a version not READY yet that is
older than every version retention keeps (``retention.outranked``) would be dropped the
moment it turned READY, and its readers would wait for a version that vanished; the
message names the versions held and the next number to publish. A shard whose
manifest differs from the one known under its number (other bytes, shapes or world)
is refused ``conflict`` naming the fix: a new number, or ``th unpublish MODEL V``.
Restoring a holding (a re-registration) is never refused as stale: what endpoints
hold is rebuilt as it was (contract 7).
"""

from __future__ import annotations

from ..layout.boxes import Box, cover_problems
from ..names import check_model
from ..planner import join
from . import protocol as p
from .draining import drop_old, settle, withdrawn_numbers
from .faults import HubFault
from .registry import READY, Replica, Version
from .retention import outranked
from .state import HubState


def model_name(name: str) -> str:
    """``name``, or a ``bad_request`` fault naming the field and the pattern."""
    try:
        return check_model(name)
    except ValueError as exc:
        raise HubFault("bad_request", str(exc)) from None


def publish(hub: HubState, now: float, op: p.Publish) -> p.Ok:
    hub.endpoint(op.name, op.incarnation)
    model_name(op.model)
    if op.version in withdrawn_numbers(hub).get(op.model, ()):
        raise HubFault("conflict", f"{op.model}@{op.version} is being withdrawn (th unpublish); publish it "
                                   "again once that is done")
    known = hub.models.get(op.model, {}).get(op.version)
    if known is None or not known.ever_ready:
        check_kept(hub, op.model, op.version)
    was = known.state if known else None
    v = add_shard(hub, op.name, op.model, op.version, op.rank, op.world, op.manifest)
    hub.count("publishes")
    if v.state == READY and was != READY:
        hub.event(now, "ready", op.name, op.model, op.version)
    settle(hub, now)
    return p.Ok()


def check_kept(hub: HubState, model: str, number: int) -> None:
    """A ``stale`` fault when retention would drop ``model@number`` once READY."""
    versions = hub.models.get(model, {})
    policy = hub.policy(model)
    kept = outranked(number, versions, policy, withdrawn_numbers(hub).get(model, ()))
    if kept:
        held = ", ".join(str(n) for n in sorted(versions, reverse=True))
        raise HubFault("stale", f"{model}@{number} would be dropped at once: the hub holds {model}@{held} and "
                                f"keeps the newest {policy.keep_latest} (keep_latest); publish "
                                f"{model}@{max(versions) + 1} or later")


def _republish_hint(model: str, number: int) -> str:
    return f"publish it under a new version, or withdraw the old one first: th unpublish {model} {number}"


def add_shard(hub: HubState, name: str, model: str, number: int, rank: int, world: int,
              manifest: p.Manifest) -> Version:
    check_manifest(manifest, number, rank, world)
    digest = p.manifest_digest(1, [manifest])
    versions = hub.models.setdefault(model, {})
    v = versions.get(number)
    if v is None:
        v = versions[number] = Version(model=model, number=number, world=world)
    elif v.world != world:
        raise HubFault("conflict", f"{model}@{number} was published with world {v.world}, not {world}: "
                                   + _republish_hint(model, number))
    elif rank in v.shard_digests and v.shard_digests[rank] != digest:
        raise HubFault("conflict", f"{model}@{number} shard {rank} exists with a different manifest (other "
                                   f"bytes, shapes or chunking): " + _republish_hint(model, number))
    rep = v.replicas.get(name)
    if rep is not None and rep.rank != rank:
        raise HubFault("conflict", f"{name} already holds {model}@{number} as {'reader' if rep.rank < 0 else f'shard {rep.rank}'}")
    check_cover(model, number, world, {**v.shards, rank: manifest})
    v.set_shard(rank, manifest, digest)
    if rep is None:
        rep = v.replicas[name] = Replica(endpoint=name, rank=rank)
        v.publishers.add(name)
    assemble(hub, v)
    if v.assembled:
        rep.held |= v.shard_mask(rank)
        index(hub, v, name)
    if v.refresh() == READY:
        drop_old(hub, model)
    return v


def assemble(hub: HubState, v: Version) -> None:
    """Assembly gives every publisher its shard's chunks at once: index them all."""
    if not v.assembled:
        v.assemble()
        for name, rep in v.replicas.items():
            if rep.held:
                index(hub, v, name)


def index(hub: HubState, v: Version, name: str) -> None:
    """``name`` holds chunks of ``v`` (more than when last indexed): plans near it will find it."""
    place = hub.endpoints[name].place
    join(v.near, place, name)
    v.holding.add(name, place.dc, v.replicas[name].held)


def restore(hub: HubState, now: float, name: str, h: p.Holding) -> None:
    if h.rank >= 0:
        add_shard(hub, name, h.model, h.version, h.rank, h.world, h.shards[0]).replicas[name].restored = True
        return
    if len(h.shards) != h.world:
        raise HubFault("malformed", "a reader's holding must carry every shard's manifest")
    digests = []
    for rank, m in enumerate(h.shards):
        check_manifest(m, h.version, rank, h.world)
        digests.append(p.manifest_digest(1, [m]))
    versions = hub.models.setdefault(h.model, {})
    v = versions.get(h.version)
    if v is not None and (v.world != h.world or any(
            v.shard_digests.get(r, d) != d for r, d in enumerate(digests))):
        raise HubFault("conflict", f"{h.model}@{h.version}: holding does not match the known manifest")
    if v is None:
        v = versions[h.version] = Version(model=h.model, number=h.version, world=h.world)
    for rank, m in enumerate(h.shards):  # a reader knows every shard, even those whose publisher is gone
        if rank not in v.shards:
            v.set_shard(rank, m, digests[rank])
    assemble(hub, v)
    v.ever_ready = True  # readers only ever read READY versions: a gap now means UNAVAILABLE
    held = 0
    for c in h.held:
        if 0 <= c < v.nchunks:
            held |= 1 << c
    rep = v.replicas.setdefault(name, Replica(endpoint=name))
    rep.restored = True
    v.respread(held & ~rep.held, hub.endpoints[name].place.dc)
    rep.held |= held
    if h.tiled and h.layout:  # tiles of our layout (contract 9): served to readers of it again
        tiles = v.layouts.setdefault(h.layout, {})
        for c in h.tiled:
            if 0 <= c < v.nchunks:
                tiles[name] = tiles.get(name, 0) | 1 << c
    if held or h.tiled:
        index(hub, v, name)
    for r in h.reading:
        # Pin even a source that has not re-registered yet: if it is alive and
        # unpublishes, this read in flight must still hold its drain back.
        if (0 <= r.chunk < v.nchunks and not held >> r.chunk & 1 and r.source != name
                and not v.reading(name) >> r.chunk & 1):
            hub.pin(v, name, r.source, 1 << r.chunk)
            if r.source in hub.endpoints:
                note_seed(hub, v, name, r.source, r.chunk)
            else:  # its DC is known once it re-registers
                hub.unplaced.setdefault(r.source, []).append((v, name, r.chunk))
    if v.refresh() == READY:
        drop_old(hub, h.model)


def note_seed(hub: HubState, v: Version, reader: str, source: str, chunk: int) -> None:
    """A rebuilt read across a DC link makes its reader that DC's seed again, and the
    DC's feeder of that chunk (scheduled readers there get it from the reader)."""
    dc = hub.endpoints[reader].place.dc
    if hub.endpoints[source].place.dc != dc:
        v.seeds.setdefault(dc, reader)
        if v.swarms.feeder(dc, chunk) is None:
            v.swarms.crossed(dc, reader, 1 << chunk)


def check_cover(model: str, number: int, world: int, shards: dict[int, p.Manifest]) -> None:
    """Contract 1 and 9: once every rank's shard is in, the pieces of each tensor agree
    on its global shape and dtype and cover it exactly once (a replicated piece is
    published by one rank only). A shard that breaks it is refused whole: the version
    stays as it was, without it."""
    if len(shards) < world:
        return
    pieces: dict[str, list[tuple[int, p.TensorMeta]]] = {}
    for rank, m in shards.items():
        for t in m.tensors:
            pieces.setdefault(t.name, []).append((rank, t))
    problems = []
    for name, held in pieces.items():
        if len(held) == 1 and not held[0][1].global_shape:
            continue  # a whole tensor, in one shard: the common case, nothing to check
        shapes = {tuple(t.global_shape or t.shape) for _, t in held}
        dtypes = {t.dtype for _, t in held}
        if len(shapes) > 1 or len(dtypes) > 1:
            problems.append(f"{name}: shards disagree on its global shape or dtype "
                            f"({', '.join(f'rank {r}: {t.global_shape or t.shape} {t.dtype}' for r, t in held)})")
            continue
        boxes = [Box(tuple(t.box_offsets or [0] * len(t.shape)), tuple(t.shape)) for _, t in held]
        problems += cover_problems(name, shapes.pop(), boxes)
    if problems:
        raise HubFault("bad_request", f"{model}@{number}: the shards' boxes do not cover each tensor exactly once: "
                                      + "; ".join(problems[:8]) + (" …" if len(problems) > 8 else ""))


def check_manifest(m: p.Manifest, number: int, rank: int, world: int) -> None:
    if number < 1:
        raise HubFault("malformed", f"version must be >= 1, got {number}")
    if not 0 <= rank < world:
        raise HubFault("malformed", f"shard rank {rank} outside world {world}")
    if not m.chunks:
        raise HubFault("malformed", "a manifest needs at least one chunk")
    if m.chunk_bytes <= 0 or any(not 0 < c.nbytes <= m.chunk_bytes for c in m.chunks):
        raise HubFault("malformed", f"chunk sizes must be in 1..chunk_bytes ({m.chunk_bytes})")
    total = sum(c.nbytes for c in m.chunks)
    for t in m.tensors:
        if t.offset < 0 or t.nbytes < 0 or t.offset + t.nbytes > total:
            raise HubFault("malformed", f"tensor {t.name!r} lies outside the {total} bytes its chunks cover")
        if any(n < 0 for n in (*t.shape, *t.global_shape, *t.box_offsets)):
            raise HubFault("malformed", f"tensor {t.name!r}: a negative size or offset in its shape or box")
        if (t.global_shape or t.box_offsets) and not len(t.global_shape) == len(t.box_offsets) == len(t.shape):
            raise HubFault("malformed", f"tensor {t.name!r}: global_shape, box_offsets and shape must have "
                                        "one entry per dimension")
