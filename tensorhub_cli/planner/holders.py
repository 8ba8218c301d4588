"""Which holders in a DC hold which chunks: the index that narrows a plan's walk.

A plan walks the version's holders in the reader's rack and DC and keeps those that
hold a chunk the reader needs. A TP reader needs its slice alone, which most holders
(readers of other slices) do not have; a late reader of a fan-out needs the few
chunks it still lacks. ``HolderIndex`` keeps, per DC, each *block* of ``BLOCK``
consecutive chunks → the holders of some chunk in it, and each holder's exact chunks;
the holders worth walking are those of the needed chunks' blocks that hold one of
them.

Blocks, not chunks, because the index is kept up on every report of every reader:
a reader's slice is a run of consecutive chunks, so a report touches a block or two
whatever the chunk size, and the hub's work per report does not grow with the chunks
(with a set per chunk it did: ``th bench sim --scale`` at 256 MiB chunks, docs/design.md).

That union is cheap when the needed chunks' blocks are few or rare and dear when they
are many and common (a joiner of a version every holder has whole), so ``relevant``
gives up (None) as soon as the union passes half the DC's holders, or at once when
visiting the needed blocks would cost more than the walk (``BLOCK_COST``); the caller
then walks. Either way a plan gets the same candidates: ``relevant`` names exactly the
holders of a needed chunk, which are the holders the walk would keep
(``Walk._gather`` rejects the others first thing), with no effect on the plan.

Protocol (kept by the hub): ``add`` each time a replica's chunks grow (they only
grow), ``drop`` when the replica is forgotten. Between the two, every holder in a DC
is in the set of every block it holds a chunk of there, and in no other.
"""

from __future__ import annotations

BLOCK = 64  # chunks a block: one machine word of a chunk bitset
BLOCK_COST = 4  # walked names a block visited by ``relevant`` costs, about


def blocks(mask: int):
    """The blocks ``mask`` has a chunk in, ascending (a step per such block, so a
    slice at the far end of a big version costs what one at the start does)."""
    base = 0
    while mask:
        b = ((mask & -mask).bit_length() - 1) // BLOCK
        yield base + b
        mask >>= (b + 1) * BLOCK
        base += b + 1


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _block_mask(mask: int) -> int:
    out = 0
    for b in blocks(mask):
        out |= 1 << b
    return out


class HolderIndex:
    __slots__ = ("_by_block", "_blocks", "_mine")

    def __init__(self) -> None:
        self._by_block: dict[str, dict[int, set[str]]] = {}  # dc -> block -> holders of a chunk in it there
        self._blocks: dict[str, int] = {}  # dc -> the blocks some holder there holds a chunk of
        self._mine: dict[str, dict[str, int]] = {}  # holder -> dc -> the chunks indexed for it

    def add(self, name: str, dc: str, held: int) -> None:
        """``name``, in ``dc``, holds ``held`` (all it holds; what is indexed already is skipped)."""
        mine = self._mine.setdefault(name, {})
        before = mine.get(dc, 0)
        new = held & ~before
        if not new:
            return
        mine[dc] = before | new
        fresh = _block_mask(new) & ~_block_mask(before)  # (a report adds to the blocks it had, mostly)
        if not fresh:
            return
        by_block = self._by_block.setdefault(dc, {})
        for b in _bits(fresh):
            holders = by_block.get(b)
            if holders is None:
                by_block[b] = {name}
            else:
                holders.add(name)
        self._blocks[dc] = self._blocks.get(dc, 0) | fresh

    def drop(self, name: str) -> None:
        """``name``'s replica is gone: it is in no block's set from now on."""
        for dc, mask in self._mine.pop(name, {}).items():
            by_block = self._by_block[dc]
            for b in blocks(mask):
                holders = by_block[b]
                holders.discard(name)
                if not holders:
                    del by_block[b]
                    self._blocks[dc] &= ~(1 << b)

    def relevant(self, dc: str, needed: int, walked: int) -> set[str] | None:
        """The holders in ``dc`` of a chunk of ``needed``, or None where walking
        ``walked`` names (the DC's holders) is the cheaper way to find them."""
        want = _block_mask(needed) & self._blocks.get(dc, 0)
        if not want:
            return set()
        # Rules chosen on `th bench hub` and `th bench sim` (docs/design.md): a looser
        # one (a union of up to 4 names per holder in the DC) cost whole-version
        # readers 12 %, as sizing and joining big sets cost more than walking them.
        if want.bit_count() * BLOCK_COST > walked:
            return None
        by_block, most, union = self._by_block[dc], walked // 2, set()
        for b in _bits(want):
            holders = by_block[b]
            if len(holders) > most:
                return None
            union |= holders
            if len(union) > most:
                return None
        mine = self._mine
        return {n for n in union if mine[n][dc] & needed}

    def holders(self, dc: str, chunk: int) -> set[str]:
        """The holders of ``chunk`` in ``dc`` (a copy; for checks and tests)."""
        return {n for n in self._by_block.get(dc, {}).get(chunk // BLOCK, ()) if self._mine[n][dc] >> chunk & 1}

    def dcs(self) -> list[str]:
        """The DCs with a holder of some chunk (the other-DC level of a walk visits these)."""
        return [dc for dc, by_block in self._by_block.items() if by_block]
