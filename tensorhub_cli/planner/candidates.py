"""Candidates for one plan, one topology level at a time: the planner's walk.

A plan asks ``Walk.levels()`` for holders cheapest level first and stops as soon as
the holders seen can fill the reader's window (``choose``), so a plan costs about
the size of the reader's own rack, not of the cluster. Levels 0–2 walk the version's
holders in the reader's node, rack and DC (``Sources.near_holders``); level 3 is the
holders in the other DCs, walked only when the reader may cross its DC link. The
rack, DC and other-DC levels walk only the holders that ``HolderIndex.relevant`` says
hold a needed chunk, where it says that is cheaper: the same candidates, fewer names.

While it walks, the walk notes the needed chunks that only busy holders have
(``busy_held``: sources at their share, publishers withholding relayed chunks,
chunks already on their way to another reader). ``deferred`` adds the chunks of
sources at their read cap in the reader's DC, which never go across a DC link.

Pure: every table is the hub's, passed by reference and only read, except the
fair-share log (``Asking.note``) and the per-DC ``spread`` cache (``rules.copies``),
which it fills.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterator, Mapping, Protocol

from .choose import Candidate
from .fairness import UNCAPPED, Asking, room
from .holders import HolderIndex
from .rules import Holding, copies, full_held, serving_mask, withheld
from .topology import Place, groups, level_between


_NONE: frozenset[str] = frozenset()


class Located(Protocol):
    """An endpoint as the planner sees it."""

    last_seen: float
    place: Place


@dataclass(slots=True)
class Reader:
    name: str
    place: Place
    needed: int  # chunks it lacks and has no read in flight for
    mine: dict[str, int] = field(default_factory=dict)  # its reads in flight, per source
    avoid: Collection[str] = ()  # sources that failed it (contract 5: last resort)
    retention_pull: bool = False  # an agent copying a retained version
    # Per source, chunks it holds for this reader only: the tiles of the reader's own
    # layout (contract 9), which no other reader could use.
    extra: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Sources:
    """The hub's tables about one version's holders (references, nothing copied)."""

    replicas: Mapping[str, Holding]
    publishers: Collection[str]
    draining: Collection[str]
    endpoints: Mapping[str, Located]
    near_holders: Mapping[tuple, set[str]]  # the version's replicas by topology group
    near_endpoints: Mapping[tuple, set[str]]  # every endpoint by topology group
    load: Mapping[str, int]  # reads in flight per source, all versions
    full: set[str]  # sources at their read cap
    serving: Mapping[str, Mapping[int, int]]  # source -> {chunk: readers}
    spread: dict[str, tuple[int, int]]  # per-DC cache of ``rules.copies``
    # ``serving`` as bitsets (source -> chunks it is sending), if the caller keeps them
    # (the hub does, in pin and unpin); else built from ``serving`` once per walk.
    sending: Mapping[str, int] | None = None
    holding: HolderIndex | None = None  # ``near_holders`` by DC and chunk, if the caller keeps it


@dataclass(slots=True)
class Limits:
    now: float
    expiry_s: float  # a source not seen for longer is not offered
    cap: int  # read slots per source once more than one reader uses it
    star: bool = False  # the baseline: publishers only, topology ignored


class Walk:
    def __init__(self, reader: Reader, sources: Sources, limits: Limits, asking: Asking):
        self.reader, self.sources, self.limits, self.asking = reader, sources, limits, asking
        self.busy_held = 0  # needed chunks only busy holders have, filled level by level
        self._relevant: set[str] | None = None  # ``HolderIndex.relevant``, asked once a walk needs it
        self._asked = False
        self._full_publishers: Collection[str] = _NONE  # publishers at their read cap (``levels``)
        self.sending = sources.sending if sources.sending is not None else {
            name: serving_mask(chunks) for name, chunks in sources.serving.items()}

    def closed(self) -> Collection[str]:
        """Draining replicas take no new reads, except the retention copy of themselves."""
        return () if self.reader.retention_pull else self.sources.draining

    def deferred(self, want: int, enough: int = 0) -> int:
        """Chunks of ``want`` that wait for busy holders in the reader's DC; only those
        the walk noted when they are ``enough`` already (``choose`` then stops)."""
        if enough > 0 and (self.busy_held & want).bit_count() >= enough:
            return self.busy_held
        s, lim, closed = self.sources, self.limits, self.closed()
        want &= ~self.busy_held
        in_dc = s.near_holders.get(("dc", self.reader.place.dc), _NONE)

        def alive(name: str) -> bool:
            ep = s.endpoints.get(name)
            return ep is not None and lim.now - ep.last_seen <= lim.expiry_s

        # Full publishers first: they hold whole shards, so they alone often hold all of
        # ``want``, and the DC's other full sources (hundreds, mid-fan-out) go unvisited.
        held = full_held([n for n in self._full_publishers if n in in_dc], s.replicas, want, closed, alive)
        if held != want:
            held |= full_held(s.full & in_dc, s.replicas, want & ~held, closed, alive)
        return self.busy_held | held

    def levels(self, may_cross: bool) -> Iterator[tuple[int, Iterator[Candidate]]]:
        s, r = self.sources, self.reader
        keys = groups(r.place)
        if self.limits.star:  # topology ignored for the choice
            yield 0, self._gather(0, s.replicas)
            return
        # A reader turned away by a full publisher still asked for it.
        self._full_publishers = s.full.intersection(s.publishers)
        for name in self._full_publishers:
            if s.replicas[name].held & r.needed:
                self.asking.note(name, r.name, self.limits.now)
        # Holders come from the version's index; what is cut out as a cheaper level
        # comes from where endpoints are, which the index cannot get wrong. (Set
        # difference runs in C: a DC of holders costs microseconds, not a Python loop.)
        # Full sources are skipped here; ``deferred`` accounts for their chunks. A level's
        # set is taken only once ``choose`` walks it (a generator's body runs on its
        # first ``next``): ``choose`` often stops at a level's coverage check, and the
        # last level's set is every other DC's holders.
        inner: Collection[str] = _NONE
        for n, key in enumerate(keys):
            yield n, self._gather(n, self._near(n, key), inner)
            inner = s.near_endpoints.get(key, _NONE)
        if may_cross:  # else ``choose`` stops before this level
            yield len(keys), self._far(len(keys), inner)

    def _far(self, n: int, inner: Collection[str]) -> Iterator[Candidate]:
        """The last level: the holders in other DCs (taken on the first ``next``, as a
        level's set is). A reader with tiles of its own layout walks every replica."""
        s, r = self.sources, self.reader
        if s.holding is None or r.extra:
            yield from self._gather(n, s.replicas.keys(), inner)
            return
        # Each other DC's holders (where the index is cheaper, those of a needed chunk),
        # not every replica: a replica in no DC's holders holds nothing yet, and the
        # walk would reject it first thing (``_near``'s argument).
        names: set[str] = set()
        for dc in s.holding.dcs():
            if dc != r.place.dc:
                there = s.near_holders.get(("dc", dc), _NONE)
                some = s.holding.relevant(dc, r.needed, len(there))
                names |= there if some is None else some
        yield from self._gather(n, names, _NONE)

    def _near(self, n: int, key: tuple) -> Collection[str]:
        """The version's holders in topology group ``key`` that may hold a needed chunk:
        all of them, or (rack and DC, where the index is cheaper) those the index names.
        (A holder left out holds none: the walk would reject it first thing, with no
        effect on the plan.)"""
        s, r = self.sources, self.reader
        names = s.near_holders.get(key, _NONE)
        # A node has a few holders, and a reader with tiles of its own layout needs
        # holders of those tiles, which the index does not keep: both walk.
        if n == 0 or s.holding is None or r.extra or not names:
            return names
        if not self._asked:
            self._asked = True
            dc = r.place.dc
            self._relevant = s.holding.relevant(dc, r.needed, len(s.near_holders.get(("dc", dc), _NONE)))
        return names if self._relevant is None else self._relevant & names

    def _gather(self, n: int, names, inner: Collection[str] | None = None) -> Iterator[Candidate]:
        """The eligible holders among ``names`` (less ``inner`` and the full sources,
        when ``inner`` is given), all at level n. (The hot loop of a plan: locals bound
        first, cheapest tests first.)"""
        s, r, lim, asking = self.sources, self.reader, self.limits, self.asking
        if inner is not None:
            names = names - inner - s.full
        replicas, endpoints, load, serving = s.replicas, s.endpoints, s.load, self.sending
        now, expiry, cap, star = lim.now, lim.expiry_s, lim.cap, lim.star
        me, here, needed, mine, avoid, extra = r.name, r.place, r.needed, r.mine, r.avoid, r.extra
        closed = self.closed()
        for name in names:
            rep = replicas.get(name)
            if rep is None:
                continue
            held = rep.held | extra.get(name, 0) if extra else rep.held
            if not held & needed or name == me or name in closed:
                continue
            if star and rep.rank < 0:
                continue
            ep = endpoints.get(name)
            if ep is None or now - ep.last_seen > expiry:
                continue
            busy = load.get(name, 0)
            if star:
                # The true level still goes into the counters, so bytes_planned.level.*
                # compare with ours.
                yield Candidate(name, rep.held, level_between(here, ep.place), busy, name in avoid)
                continue
            publisher = rep.rank >= 0
            if publisher and not avoid:
                # A publisher sends into a DC only chunks no reader there has yet, while
                # it has such chunks (``rules.withheld``): readers relay the rest (never
                # fetched across a DC instead). A reader that met a bad holder may have
                # any chunk from it again (contract 5).
                relayed = s.spread.get(here.dc)
                if relayed is None:
                    relayed = s.spread[here.dc] = copies(
                        s.near_holders.get(("dc", here.dc), ()), replicas, s.draining)
                relayed = withheld(rep.held, *relayed, serving.get(name, 0))
                self.busy_held |= held & relayed & needed
                held &= ~relayed
                if not held & needed:
                    continue
            # Fair shares only at publishers: they are few (so this stays cheap with
            # thousands of relays) and they are where readers queue.
            others = asking.others(name, me, now) if publisher else 0
            own = mine.get(name, 0)
            # ``room`` inline where no other reader asked (most candidates: a call per
            # candidate costs about 5 % of a plan); capped only by reads not its own.
            if not others:
                slots = UNCAPPED if busy <= own else cap - busy
            else:
                slots = room(cap, busy, own, others)
            if slots <= 0:
                self.busy_held |= held & needed
                if publisher:
                    asking.note(name, me, now)
                continue
            # A chunk this source is already sending to another reader will be at that
            # reader soon: fetch it from there, so it leaves here once.
            if name in serving:
                sending = serving[name]
                self.busy_held |= held & sending & needed
                held &= ~sending
            if held & needed:
                yield Candidate(name, held, n, busy, name in avoid, publisher, slots)
