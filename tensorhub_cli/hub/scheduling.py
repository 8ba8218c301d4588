"""A reader's schedule at the hub: what ``plan`` does for a ``Plan`` with ``schedule``.

Protocol. A reader's first scheduled plan of a version makes it a member of its swarm
(``planner.schedule``) and gets a read for every chunk it still needs: from a tree
parent for each stripe a parent can feed (``Read.ready`` False while the parent does
not hold the chunk yet: the reader waits for the parent's notice), from the *roots*
for the rest. Its later plans carry its progress (coarse: a batch of verified chunks;
failures at once) and are answered with the reads still outstanding; chunks whose read
failed, whose source expired, or that nobody could feed before, go to the roots then.

Roots, in order (contract 8: cost before load): holders of the chunk now in the
reader's node, rack and DC (``planner.choose``: cheapest level, then least scheduled
load, a reader before a publisher; a publisher offers only chunks no reader in the DC
holds, ``rules.copies``); then a member of the reader's DC that brings the
chunk across the DC link (``Swarms.feeders``); then a holder in another DC, which makes
this reader the DC's feeder of that chunk. So each chunk crosses into a DC once, and
the crossing is striped over the DC's swarms (each swarm's first members bring their
stripes), not funnelled through one seed.

Every scheduled read is pinned at once on its source (contract 3: a drain of the
source waits for it, and load counts it), and unpinned when the reader reports it.
The "star" planner (the baselines) schedules every chunk straight from a publisher.
"""

from __future__ import annotations

from ..planner import Candidate, PlanResult, choose, copies
from ..planner.schedule import Swarms
from ..planner.topology import REMOTE, groups, level_between
from .registry import Version, bits
from .state import Endpoint, HubState

_NONE: frozenset[str] = frozenset()


def assign(hub: HubState, now: float, v: Version, reader: Endpoint, want: int, needed: int) -> PlanResult:
    """Sources for every chunk of ``needed`` that one can be found for; ``waiting``
    counts the rest (no holder yet: the reader asks again with its next report)."""
    if not needed:
        return PlanResult()
    avoid = v.avoid.get(reader.name, set())
    swarms: Swarms = v.swarms
    result = PlanResult()
    if hub.config.planner == "star":
        _roots(hub, now, v, reader, needed, avoid, result, star=True)
        return result
    rest = needed
    if not swarms.member(reader.name):
        def usable(name: str) -> bool:
            return _usable(hub, now, v, name)

        for stripe, parent in swarms.join(reader.name, reader.place.dc, want, usable, avoid,
                                          chains=lambda: heads(hub, v, reader.place.dc, want),
                                          local=lambda: local(hub, v, reader.place.dc, want)):
            if parent is None:
                continue
            mine = stripe & rest
            if mine:
                result.fed.append((parent, level_between(reader.place, hub.endpoints[parent].place), mine))
            rest &= ~mine
    _roots(hub, now, v, reader, rest, avoid, result)
    return result


MAX_CHAINS = 64


def heads(hub: HubState, v: Version, dc: str, want: int) -> int:
    """How many chain heads the publishers can feed a swarm of (dc, want) at full rate:
    a head reads the want in the time a publisher sends it its part, so a publisher
    whose shard holds 1/c of the want can feed c heads at once; the swarm gets the
    fewest any such publisher allows. One where a publisher of a wanted chunk is in
    another DC: the swarm's roots lie across the DC link, and one chain keeps its
    crossing to one copy (``Swarms.feeders``)."""
    total = v.bytes_of(want)
    fewest = MAX_CHAINS
    for part, where in publishers_of(hub, v, want):
        if where is None or where.place.dc != dc:
            return 1
        fewest = min(fewest, total // max(1, v.bytes_of(part)))
    return max(1, fewest)


def local(hub: HubState, v: Version, dc: str, want: int) -> bool:
    """Whether every publisher of a chunk of ``want`` is in ``dc``."""
    return all(where is not None and where.place.dc == dc for _, where in publishers_of(hub, v, want))


def publishers_of(hub: HubState, v: Version, want: int):
    """(its chunks of ``want``, its ``Endpoint`` or None) for each publisher holding some."""
    for name in v.publishers:
        rep = v.replicas.get(name)
        if rep is None or rep.rank < 0 or rep.rank >= len(v.offsets):
            continue
        part = want & v.shard_mask(rep.rank)
        if part:
            yield part, hub.endpoints.get(name)


def _roots(hub: HubState, now: float, v: Version, reader: Endpoint, chunks: int, avoid, result: PlanResult,
           star: bool = False) -> None:
    if not chunks:
        return
    dc = reader.place.dc
    near = choose(needed=chunks, start=0, limit=chunks.bit_count(),
                  levels=_levels(hub, now, v, reader, chunks, avoid, star), may_cross=True)
    result.assigned += near.assigned
    result.fed += near.fed
    chunks &= ~near.chunks()
    if star or not chunks:
        result.waiting = chunks.bit_count()
        return
    swarms: Swarms = v.swarms
    for chunk in bits(chunks):
        feeder = swarms.feeder(dc, chunk)
        if feeder is None or feeder == reader.name or feeder in avoid or not _usable(hub, now, v, feeder):
            continue
        result.assigned.append((chunk, feeder, level_between(reader.place, hub.endpoints[feeder].place)))
        chunks &= ~(1 << chunk)
    if chunks:
        far = choose(needed=chunks, start=0, limit=chunks.bit_count(),
                     levels=[(REMOTE, _candidates(hub, now, v, reader, _far(v, dc, chunks), REMOTE, chunks, avoid))],
                     may_cross=True)
        crossed = far.chunks()
        result.assigned += far.assigned
        result.fed += far.fed
        swarms.crossed(dc, reader.name, crossed)
        chunks &= ~crossed
    result.waiting = chunks.bit_count()


def _levels(hub: HubState, now: float, v: Version, reader: Endpoint, chunks: int, avoid, star: bool):
    """Holders near the reader, a level at a time (``choose`` stops once covered)."""
    if star:  # publishers only, topology ignored for the choice (each keeps its true level for the counters)
        yield 0, _candidates(hub, now, v, reader, [n for n in v.publishers if n in v.replicas], None, chunks, avoid)
        return
    dc = reader.place.dc
    relevant = None
    inner: set[str] = set()
    for level, key in enumerate(groups(reader.place)):
        names = v.near.get(key, _NONE)
        if level and names:  # rack and DC: only the holders of a needed chunk, where the index is cheaper
            if relevant is None:
                some = v.holding.relevant(dc, chunks, len(v.near.get(("dc", dc), _NONE)))
                relevant = False if some is None else some
            if relevant is not False:
                names = relevant & names
        yield level, _candidates(hub, now, v, reader, names - inner if inner else names, level, chunks, avoid)
        inner = v.near.get(key, _NONE)


def _far(v: Version, dc: str, chunks: int) -> set[str]:
    """The holders of a chunk of ``chunks`` in the other DCs."""
    names: set[str] = set()
    for other in v.holding.dcs():
        if other != dc:
            there = v.near.get(("dc", other), _NONE)
            some = v.holding.relevant(other, chunks, len(there))
            names |= there if some is None else some
    return names


def _candidates(hub: HubState, now: float, v: Version, reader: Endpoint, names, level: int | None, chunks: int,
                avoid) -> list[Candidate]:
    relayed = None
    out = []
    for name in names:
        rep = v.replicas.get(name)
        if rep is None or name == reader.name or not rep.held & chunks:
            continue
        if name in v.draining or not hub.alive(now, name):
            continue
        held = rep.held
        if rep.rank >= 0 and not avoid and level is not None:
            # A publisher sends into a DC only chunks no reader there holds (its link is
            # the scarce one: a joiner of a replicated version reads it from readers
            # even where the trainer is nearer). A reader that met a bad holder may
            # have any chunk from it (contract 5).
            if relayed is None:
                dc = reader.place.dc
                relayed = v.spread.get(dc)
                if relayed is None:
                    relayed = v.spread[dc] = copies(v.near.get(("dc", dc), _NONE), v.replicas, v.draining)
            held &= ~relayed[0]
            if not held & chunks:
                continue
        at = level_between(reader.place, hub.endpoints[name].place) if level is None else level
        out.append(Candidate(name, held, at, hub.load.get(name, 0), name in avoid, rep.rank >= 0))
    return out


def _usable(hub: HubState, now: float, v: Version, name: str) -> bool:
    """May ``name`` still feed readers of ``v``: alive, its replica kept, not draining."""
    return name in v.replicas and name not in v.draining and hub.alive(now, name)

