"""Choose a source per chunk: cheapest topology level first, then least loaded.

Contract 8. Levels: 0 same node, 1 same rack, 2 same DC, 3 another DC. A reader that
may not cross (its DC already has a *seed* pulling across the link) waits for chunks
only other-DC holders have; the seed's partial replica will offer them soon. Load is
reads in flight from a source, counted as they are assigned, so one plan call already
spreads its chunks over equally cheap sources.

Assignment is greedy by source, not by chunk: the best candidate (trusted before
suspect, cheapest level, least load) takes the next unassigned chunk it holds, one
no other candidate holds first (rarest first), so
chunks cheap sources have go first and a chunk only a dear source has waits its turn
(a nearer partial holder may have it by the next plan). Each source's pick starts at
a per-reader offset (``start``), so readers that begin together fetch different
chunks first and can serve each other sooner. Cost: O(candidates + window · log
candidates) big-int operations per plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable

from .topology import REMOTE


@dataclass(slots=True)
class Candidate:
    """A holder a reader may read from. Better first: trusted, cheaper level, not a
    publisher, less load, then name (so plans are deterministic); ``_rank`` is that order."""

    name: str
    held: int
    level: int
    load: int
    suspect: bool = False  # failed this reader before: used only when nothing else holds the chunk
    # A publisher (a trainer rank): at equal cost a reader that holds the chunk goes
    # first, so the publisher's link carries fresh chunks and the trainer is not the
    # one feeding every reader.
    publisher: bool = False
    room: int = 1 << 30  # reads it may still take on (the hub's per-source cap)


def _rank(c: Candidate, i: int) -> tuple:
    return (c.suspect, c.level, c.publisher, c.load, c.name, i)


@dataclass
class PlanResult:
    assigned: list[tuple[int, str, int]] = field(default_factory=list)  # (chunk, source, level)
    # A source's chunks at once, as a schedule assigns them (a tree parent's stripe):
    # the hub's work per plan stays per source, whatever the chunk count.
    fed: list[tuple[str, int, int]] = field(default_factory=list)  # (source, level, chunks)
    waiting: int = 0  # needed chunks no allowed source holds (counted when every level was built)

    @property
    def crossed(self) -> bool:
        return any(level == REMOTE for _, _, level in self.assigned) or any(
            level == REMOTE for _, level, _ in self.fed)

    def chunks(self, level: int | None = None) -> int:
        """The chunks assigned (at ``level`` only, if given), as a bitset."""
        out = 0
        for chunk, _, at in self.assigned:
            if level is None or at == level:
                out |= 1 << chunk
        for _, at, chunks in self.fed:
            if level is None or at == level:
                out |= chunks
        return out

    def reads(self) -> list[tuple[int, str, int]]:
        """Every assigned read, both kinds, as (chunk, source, level) by chunk."""
        out = list(self.assigned)
        for source, level, chunks in self.fed:
            mask = chunks
            while mask:
                low = mask & -mask
                out.append((low.bit_length() - 1, source, level))
                mask ^= low
        return sorted(out)

    def by_source(self) -> dict[tuple[str, int], int]:
        """(source, level) -> the chunks assigned to it, both kinds together."""
        by: dict[tuple[str, int], int] = {}
        for source, level, chunks in self.fed:  # (first: a schedule's tree parents come before its roots)
            by[source, level] = by.get((source, level), 0) | chunks
        for chunk, source, level in self.assigned:
            by[source, level] = by.get((source, level), 0) | 1 << chunk
        return by


def choose(needed: int, start: int, limit: int, levels: Iterable[tuple[int, Iterable[Candidate]]],
           may_cross: bool, deferred=lambda want, enough=0: 0) -> PlanResult:
    """Assign up to ``limit`` chunks of ``needed`` (a bitset) to candidates.

    ``levels`` yields ``(level, candidates)`` cheapest level first, and is consumed only
    until the trusted (non-suspect) candidates seen so far hold ``limit`` of the needed
    chunks. A dearer source is only ever popped once no cheaper one holds a chunk still
    unassigned, so the levels not built cannot change the result; that keeps a plan's
    cost near the size of the reader's own rack, not of the cluster.

    ``deferred(want)`` is the mask of chunks in ``want`` that holders at the levels
    consumed so far have but cannot serve now (busy): those chunks wait for them and are never
    taken from another DC, so a busy holder inside the DC never sends a read across
    a DC link (contract 8: cost before load). Inside a DC a busy cheaper holder
    does not hold a reader back: a rack uplink has room for it, and waiting idles
    the publisher's rack (docs/design.md, "Measurements behind the defaults").
    ``deferred(want, enough)`` may answer part of that mask once the part holds
    ``enough`` chunks of ``want``: that many already end the walk before the dearer
    level, as the whole mask would.
    """
    if limit <= 0 or not needed:
        return PlanResult()
    ranked: list[Candidate] = []
    suspects: list[Candidate] = []
    covered = 0
    enough = min(limit, needed.bit_count())
    exhausted = True
    for level, candidates in levels:
        if level == REMOTE and not may_cross:
            break
        block = deferred(needed & ~covered, enough - (needed & covered).bit_count()) if level == REMOTE else 0
        if (needed & (covered | block)).bit_count() >= enough:
            exhausted = False
            break
        for cand in candidates:
            if block:
                cand.held &= ~block
                if not cand.held & needed:
                    continue
            if cand.suspect:
                suspects.append(cand)
            else:
                ranked.append(cand)
                covered |= cand.held
        if (needed & covered).bit_count() >= enough:
            exhausted = False
            break
    if exhausted:  # every allowed level is in: suspects are the last resort
        ranked += suspects
        for cand in suspects:
            covered |= cand.held
    result = PlanResult(waiting=(needed & ~covered).bit_count() if exhausted else 0)
    # Chunks two or more candidates hold. A source first gives what only it has
    # (rarest first): a publisher then sends fresh chunks while readers relay the ones
    # they already hold, instead of the publisher sending those a second time.
    once = shared = 0
    for cand in ranked:
        shared |= once & cand.held
        once |= cand.held
    if limit >= needed.bit_count() and not shared & needed and all(
            c.room >= (c.held & needed).bit_count() for c in ranked):
        # Every needed chunk has one holder among them and may all be assigned (a
        # schedule's roots, most often: the publishers' disjoint shards): the greedy
        # would give each holder its chunks, so give them at once, a source at a time.
        result.fed = [(c.name, c.level, c.held & needed) for c in ranked if c.held & needed]
        return result
    _greedy(result, ranked, needed, shared, start, limit)
    return result


def _greedy(result: PlanResult, ranked: list[Candidate], needed: int, shared: int, start: int, limit: int) -> None:
    # Greedy by source: the cheapest, least-loaded candidate takes the next chunk it
    # holds that is still unassigned, its load grows by one, and it goes back in line.
    heap = [_rank(c, i) for i, c in enumerate(ranked)]
    heapq.heapify(heap)
    left = needed
    # Chunks a candidate still holds when its room runs out wait for it rather than
    # cross a DC link (cost before load, as for ``deferred``).
    reserved = [0] * (REMOTE + 1)
    while heap and left and len(result.assigned) < limit:
        i = heapq.heappop(heap)[-1]
        cand = ranked[i]
        mine = left & cand.held
        if cand.level == REMOTE:
            for cheaper in range(REMOTE):
                mine &= ~reserved[cheaper]
        chunk = first_bit(mine & ~shared, start)
        if chunk < 0:
            chunk = first_bit(mine, start)
        if chunk < 0:
            continue  # holds nothing still needed: out of line for good
        left &= ~(1 << chunk)
        result.assigned.append((chunk, cand.name, cand.level))
        cand.load += 1
        cand.room -= 1
        if cand.room > 0:
            heapq.heappush(heap, _rank(cand, i))
        else:
            reserved[cand.level] |= cand.held & left


def first_bit(mask: int, start: int) -> int:
    """Lowest set bit of ``mask`` at or after ``start``, wrapping around; -1 if none."""
    high = mask >> start
    if high:
        return start + (high & -high).bit_length() - 1
    return (mask & -mask).bit_length() - 1 if mask else -1
