"""Choose a source per chunk: cheapest topology level first, then least loaded.

Contract 8. Levels: 0 same node, 1 same rack, 2 same DC, 3 another DC. A reader that
may not cross (its DC already has a *seed* pulling across the link) waits for chunks
only other-DC holders have; the seed's partial replica will offer them soon. Load is
reads in flight from a source, counted as they are assigned, so one plan call already
spreads its chunks over equally cheap sources.

Readers start their walk over chunk ids at different offsets (``start``), so readers
that begin together fetch different chunks first and can serve each other sooner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hub.registry import bits

LEVELS = ("node", "rack", "dc", "remote")
REMOTE = 3


@dataclass(frozen=True)
class Place:
    node: str
    rack: str
    dc: str


def cost(reader: Place, source: Place) -> int:
    if reader.dc != source.dc:
        return REMOTE
    if reader.rack != source.rack:
        return 2
    return 0 if reader.node == source.node else 1


@dataclass
class Candidate:
    name: str
    held: int
    level: int
    load: int
    suspect: bool = False  # failed this reader before: used only when nothing else holds the chunk

    def key(self) -> tuple:
        return (self.suspect, self.level, self.load, self.name)


@dataclass
class PlanResult:
    assigned: list[tuple[int, str, int]] = field(default_factory=list)  # (chunk, source, level)
    waiting: int = 0  # chunks seen (before the limit was reached) that no allowed source holds yet

    @property
    def crossed(self) -> bool:
        return any(level == REMOTE for _, _, level in self.assigned)


def choose(needed: int, start: int, limit: int, candidates: list[Candidate], may_cross: bool) -> PlanResult:
    """Assign up to ``limit`` chunks of ``needed`` (a bitset) to ``candidates``."""
    ranked = sorted(candidates, key=Candidate.key)
    if not may_cross:
        ranked = [c for c in ranked if c.level < REMOTE]
    result = PlanResult()
    for chunk in bits(needed, start):
        if len(result.assigned) >= limit:
            break
        bit = 1 << chunk
        for i, cand in enumerate(ranked):
            if cand.held & bit:
                break
        else:
            result.waiting += 1
            continue
        result.assigned.append((chunk, cand.name, cand.level))
        cand.load += 1
        # keep ``ranked`` sorted: only this candidate's key grew
        while i + 1 < len(ranked) and ranked[i + 1].key() < cand.key():
            ranked[i], ranked[i + 1] = ranked[i + 1], ranked[i]
            i += 1
    return result
