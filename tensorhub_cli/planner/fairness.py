"""Which readers asked for which publisher lately: what its fair share divides by.

A reader reports finished reads in the same message that asks for new ones, so the
reader whose read just finished is always first in line for the slot it freed. If
only reads in flight counted, one early reader would keep every slot of a source
while the others idle (docs/design.md, "Measurements behind the defaults"). So a
plan notes, per source, the readers it gave reads of that source or turned
away from it; a reader noted within ``window_s`` that still fetches competes for
that source, and each competitor may hold ``cap // competitors`` of its reads (at
least one).

The hub tracks publishers only: they are few, and they are where readers queue;
a relay's readers are spread over many relays by the per-source cap alone.

Bounded work: a source's entries are pruned at most once per ``window_s``, so a stale
asker counts for at most twice that long; a reader that completes or leaves stops
counting at once.
"""

from __future__ import annotations


class Asking:
    def __init__(self, window_s: float = 0.25):
        self.window_s = window_s
        self._by_source: dict[str, dict[str, float]] = {}
        self._pruned: dict[str, float] = {}
        self._by_reader: dict[str, set[str]] = {}

    def note(self, source: str, reader: str, now: float) -> None:
        """``reader`` wants reads of ``source``: it got some, or was turned away."""
        self._by_source.setdefault(source, {})[reader] = now
        self._pruned.setdefault(source, now)
        self._by_reader.setdefault(reader, set()).add(source)

    def others(self, source: str, reader: str, now: float) -> int:
        """How many readers other than ``reader`` wanted reads of ``source`` lately."""
        askers = self._by_source.get(source)
        if not askers:
            return 0
        if now - self._pruned[source] > self.window_s:
            for name in [n for n, t in askers.items() if now - t > self.window_s]:
                del askers[name]
                self._by_reader.get(name, set()).discard(source)
            self._pruned[source] = now
        return len(askers) - (reader in askers)

    def done(self, reader: str) -> None:
        """``reader`` asks for nothing now (its fetch completed or was cancelled)."""
        for source in self._by_reader.pop(reader, ()):
            self._by_source.get(source, {}).pop(reader, None)

    def forget(self, name: str) -> None:
        """``name`` is gone, as a reader and as a source."""
        self.done(name)
        if self._by_source.pop(name, None) is not None:
            del self._pruned[name]


UNCAPPED = 1 << 30  # a source nobody else asks for: the reader's window decides


def room(cap: int, busy: int, mine: int, others: int) -> int:
    """Reads a reader may still start at a source of ``cap`` read slots, ``busy`` of
    them in flight (``mine`` of those its own), that ``others`` other readers asked
    for lately. Alone at a source, a reader is not capped; otherwise each asker may
    hold ``cap // askers`` (at least one) and the source never exceeds ``cap``. Zero
    or less: the reader waits for this source or goes elsewhere."""
    if not others and busy <= mine:
        return UNCAPPED
    return min(cap - busy, max(1, cap // (1 + others)) - mine)
