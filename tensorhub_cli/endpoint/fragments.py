"""Fragments: a chunk read in several reads, so a chain's child follows its parent a
fragment behind instead of a whole chunk (docs/design.md, "Fragments").

Protocol. The reader core (``endpoint.reader``) owns one ``Fragments`` table beside
its chunk states and consults it only for ``READING`` chunks (and, through ``avail``,
for ``READY`` ones whose source holds part of them). For a chunk it starts, ``applies``
says whether to read it in fragments; if so ``begin`` then ``next`` gives the first read
as ``(at, nbytes)``, or None while the source has not landed those bytes (the chunk is
then ``stalled`` until ``resume``). ``landed`` records the end of the fragment in flight
and says how many bytes are in, counted from the first; the chunk is whole once that is
its size. ``forget`` clears a chunk once it leaves ``READING`` (a read given up starts
again from its first byte). Nothing here is a claim about the bytes' correctness: only
the whole chunk is verified, by the core, as before.

Fragment boundaries fall on multiples of ceil(size / count), however much the source had
landed when a read started, so a child's reads line up with its parent's ``Relay``s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Fragments:
    count: int = 1  # reads per chunk (1: whole chunks only)
    size: Callable[[int], int] | None = None  # chunk -> its bytes (needed when count > 1)
    whole: set[int] = field(default_factory=set)  # chunks the driver reads whole (a delta's)
    got: dict[int, int] = field(default_factory=dict)  # chunk -> bytes landed here, from the first
    fragment: dict[int, int] = field(default_factory=dict)  # chunk -> the end of its fragment in flight
    stalled: set[int] = field(default_factory=set)  # waiting on the source's next fragment
    # Bytes the source has landed of a READY/READING chunk (absent: all of it).
    avail: dict[int, int] = field(default_factory=dict)
    relayed: set[int] = field(default_factory=set)  # chunks whose landed bytes we told (until held)

    def applies(self, c: int, *, tiled: bool, waited_for: bool) -> bool:
        """Read ``c`` in fragments: a child may be waiting for it (``waited_for``: we head
        a chain, or its source relays it), or the source has only part of it yet."""
        return self.count > 1 and not tiled and c not in self.whole and (waited_for or c in self.avail)

    def begin(self, c: int) -> None:
        self.got[c] = 0

    def next(self, c: int) -> tuple[int, int] | None:
        """The next read of ``c`` (none in flight): ``(at, nbytes)``, or None (and ``c``
        stalled) while the source has not landed it."""
        at, size = self.got.get(c, 0), self.size(c)
        step = -(-size // self.count)
        end = min(size, (at // step + 1) * step, self.avail.get(c, size))
        if end <= at:
            self.stalled.add(c)
            return None
        self.fragment[c] = end
        return at, end - at

    def landed(self, c: int) -> int:
        """The fragment in flight landed: the bytes of ``c`` in, from its first."""
        self.got[c] = self.fragment.pop(c)
        self.relayed.add(c)
        return self.got[c]

    def resume(self, c: int) -> bool:
        """The source has more of ``c``: True when ``c`` was stalled (read on)."""
        if c in self.stalled:
            self.stalled.discard(c)
            return True
        return False

    def partial(self):
        """Chunks whose source has landed only part of them."""
        return (c for c, n in self.avail.items() if n < self.size(c))

    def limit(self, c: int, read_timeout: float) -> float:
        """How long ``c``'s transfer may run: a fragment its share of ``read_timeout`` (a
        slow source is given up on after the same time for the chunk, however cut)."""
        if c in self.fragment:
            return read_timeout * (self.fragment[c] - self.got.get(c, 0)) / self.size(c)
        return read_timeout

    def forget(self, c: int) -> None:
        """``c`` left ``READING``."""
        self.got.pop(c, None)
        self.fragment.pop(c, None)
        self.stalled.discard(c)
