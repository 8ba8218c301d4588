"""Which holders in a DC hold which chunk: the index that narrows a plan's walk.

A plan walks the version's holders in the reader's rack and DC and keeps those that
hold a chunk the reader needs. A TP reader needs its slice alone, which most holders
(readers of other slices) do not have; a late reader of a fan-out needs the few
chunks it still lacks. For each DC, ``HolderIndex`` maps chunk → holders of it, so
the holders worth walking are the union of the needed chunks' sets.

That union is cheap when the needed chunks are few or rare and dear when they are
many and common (a joiner of a version every holder has whole), so ``relevant``
gives up (None) as soon as the union passes half the DC's holders, or at once when
visiting the needed chunks would cost more than the walk (``CHUNK_COST``); the caller
then walks. Either way a plan gets the same candidates: the index leaves out only
holders that hold none of the needed chunks, which the walk rejects first thing
(``Walk._gather``), with no effect on the plan.

Protocol (kept by the hub): ``add`` each time a replica's chunks grow (they only
grow), ``drop`` when the replica is forgotten. Between the two, every holder in a DC
is in the set of every chunk it holds there, and in no other.
"""

from __future__ import annotations

CHUNK_COST = 4  # walked names a chunk visited by ``relevant`` costs, about


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class HolderIndex:
    __slots__ = ("_by_chunk", "_held", "_mine")

    def __init__(self) -> None:
        self._by_chunk: dict[str, dict[int, set[str]]] = {}  # dc -> chunk -> its holders there
        self._held: dict[str, int] = {}  # dc -> the chunks some holder there holds
        self._mine: dict[str, dict[str, int]] = {}  # holder -> dc -> the chunks indexed for it

    def add(self, name: str, dc: str, held: int) -> None:
        """``name``, in ``dc``, holds ``held`` (all it holds; what is indexed already is skipped)."""
        mine = self._mine.setdefault(name, {})
        new = held & ~mine.get(dc, 0)
        if not new:
            return
        mine[dc] = mine.get(dc, 0) | new
        by_chunk = self._by_chunk.setdefault(dc, {})
        for chunk in _bits(new):
            holders = by_chunk.get(chunk)
            if holders is None:
                by_chunk[chunk] = {name}
            else:
                holders.add(name)
        self._held[dc] = self._held.get(dc, 0) | new

    def drop(self, name: str) -> None:
        """``name``'s replica is gone: it is in no chunk's set from now on."""
        for dc, mask in self._mine.pop(name, {}).items():
            by_chunk = self._by_chunk[dc]
            for chunk in _bits(mask):
                holders = by_chunk[chunk]
                holders.discard(name)
                if not holders:
                    del by_chunk[chunk]
                    self._held[dc] &= ~(1 << chunk)

    def relevant(self, dc: str, needed: int, walked: int) -> set[str] | None:
        """The holders in ``dc`` of a chunk of ``needed``, or None where walking
        ``walked`` names (the DC's holders) is the cheaper way to find them."""
        want = needed & self._held.get(dc, 0)
        if not want:
            return set()
        # Rules chosen on `th bench hub` and `th bench sim` (docs/design.md): a looser
        # one (a union of up to 4 names per holder in the DC) cost whole-version
        # readers 12 %, as sizing and joining big sets cost more than walking them.
        if want.bit_count() * CHUNK_COST > walked:
            return None
        by_chunk, most, union = self._by_chunk[dc], walked // 2, set()
        for chunk in _bits(want):
            holders = by_chunk[chunk]
            if len(holders) > most:
                return None
            union |= holders
            if len(union) > most:
                return None
        return union

    def holders(self, dc: str, chunk: int) -> set[str]:
        """The holders of ``chunk`` in ``dc`` (a copy; for checks and tests)."""
        return set(self._by_chunk.get(dc, {}).get(chunk, ()))

    def dcs(self) -> list[str]:
        """The DCs with a holder of some chunk (the other-DC level of a walk visits these)."""
        return [dc for dc, chunks in self._by_chunk.items() if chunks]
