"""Schedules: which holder feeds which reader which chunks, decided once per reader
when it joins a version's readers and changed only on events.

Shape. The readers of one version that want the same chunks in the same DC form a
*swarm*. The chunks they want are dealt into ``k`` *stripes* (the i-th wanted chunk
goes to stripe i mod k). A member is *interior* in one stripe (its join index mod k)
and a leaf in the others; in its interior stripe it feeds up to ``k`` later members.
A joining member takes each stripe from the earliest member with a free slot there
(breadth first, so each stripe's tree stays about log_k(n) deep), or, where none has
one, from the *roots* (``Roots``, the hub's: holders that hold the chunks now, then a
DC member that will hold them, then across the DC link). So a member uploads at most
what it downloads (k children × 1/k of its chunks; the first member also feeds
the first interior member of each other stripe), the roots send the swarm one copy,
and a chunk moves down a tree as soon as each parent has verified it: the
child waits for its parent's notice (``Read.ready`` False), never for the hub.

Why k = 1 (one pipelined chain per swarm) by default. Members join in arrival order,
so in each stripe every interior member's k slots go to the next k arrivals, one of
them the next interior member: the trees are chains of n/k interior members whatever
k is, and the lag a level adds is one chunk's transfer at 1/k of a link, so the tail
is about n chunk times either way. k > 1 only adds the first member's extra uploads.
On the 8-node testbed (``th bench fanout --testbed``, N = 7): k = 1 took 1.46 × the
bound, k = 2 1.99 ×. A log-depth forest needs members re-parented as later ones join
(SplitStream's push-down); not done.

Cycles cannot form: a tree parent joined before its child, and a member that asks
again (a read failed, a parent died or fell behind) is given roots only, never a tree
parent; roots hold the chunk now or got it from a root themselves (``feeders``).

Pure: no sockets, no hub classes. ``Swarms`` is kept per version by the hub
(``hub/scheduling.py``); ``deal`` and ``tree_parents`` answer from it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection

STRIPES = 1  # k: stripes and fan-out (1: one chain per swarm; see the module docstring)


def deal(want: int, k: int) -> list[int]:
    """``want``'s chunks dealt into ``k`` stripes, as bitsets: the i-th chunk (ascending)
    in stripe i mod k, so each stripe holds an even share whatever ``want``'s shape."""
    stripes = [0] * k
    i, rest = 0, want
    while rest:
        low = rest & -rest
        stripes[i % k] |= low
        rest ^= low
        i += 1
    return stripes


@dataclass(slots=True)
class Member:
    name: str
    index: int  # join order within its swarm
    slots: dict[int, int]  # stripe -> children it may still take there


@dataclass(slots=True)
class Swarm:
    """The readers of one version that want ``want`` in one DC."""

    dc: str
    want: int
    stripes: list[int]
    members: dict[str, Member] = field(default_factory=dict)
    # Per stripe: members with a free slot there, earliest first (breadth first).
    open: list[deque[Member]] = field(default_factory=list)



@dataclass
class Swarms:
    """One version's swarms, and per DC the member that brings each chunk into it
    from another DC (``feeders``: each chunk crosses a DC link once)."""

    k: int = STRIPES
    by_key: dict[tuple[str, int], Swarm] = field(default_factory=dict)
    of: dict[str, Swarm] = field(default_factory=dict)  # member -> its swarm
    feeders: dict[str, dict[int, str]] = field(default_factory=dict)  # dc -> chunk -> member

    def member(self, name: str) -> bool:
        return name in self.of

    def join(self, name: str, dc: str, want: int, usable: Callable[[str], bool],
             avoid: Collection[str] = ()) -> list[tuple[int, str | None]]:
        """``name`` joins the swarm of (dc, want): per stripe, the chunks and the tree
        parent that feeds them (None: the stripe goes to the roots). ``usable(parent)``
        says whether a parent may still feed anyone (alive, not draining): those that
        may not leave the swarm's open lists for good; ``avoid`` (parents that failed
        this reader) are passed over for this reader only."""
        swarm = self.by_key.get((dc, want))
        if swarm is None:
            stripes = deal(want, self.k)
            swarm = self.by_key[(dc, want)] = Swarm(dc, want, stripes, open=[deque() for _ in stripes])
        out: list[tuple[int, str | None]] = []
        for s, chunks in enumerate(swarm.stripes):
            out.append((chunks, _take_parent(swarm.open[s], s, usable, avoid)))
        index = len(swarm.members)
        slots = {index % self.k: self.k}
        if index == 0:
            # The first member takes every stripe from the roots; it also feeds the
            # first interior member of each other stripe, so the roots (often one
            # trainer's link) send the swarm one copy, not one plus a stripe per stripe.
            slots.update({s: 1 for s in range(1, self.k)})
        me = Member(name, index, slots)
        swarm.members[name] = me
        for s in sorted(slots):
            swarm.open[s].append(me)
        self.of[name] = swarm
        return out

    def leave(self, name: str) -> None:
        """``name`` feeds no one from now on (it died, left or drains); its children
        find out when their reads from it fail, and ask again (roots only)."""
        swarm = self.of.pop(name, None)
        if swarm is None:
            return
        me = swarm.members.pop(name)
        me.slots.clear()  # dropped from ``open`` lazily, by ``_take_parent``
        for dc_feeders in self.feeders.values():
            for chunk in [c for c, n in dc_feeders.items() if n == name]:
                del dc_feeders[chunk]

    def feeder(self, dc: str, chunk: int) -> str | None:
        return self.feeders.get(dc, {}).get(chunk)

    def crossed(self, dc: str, name: str, chunks: int) -> None:
        """``name`` brings ``chunks`` into ``dc`` across its link: later readers there get them from it."""
        table = self.feeders.setdefault(dc, {})
        rest = chunks
        while rest:
            low = rest & -rest
            table[low.bit_length() - 1] = name
            rest ^= low

    def unfeed(self, dc: str, chunk: int, name: str) -> None:
        """A read of ``chunk`` from feeder ``name`` failed: it feeds that chunk no more."""
        table = self.feeders.get(dc)
        if table is not None and table.get(chunk) == name:
            del table[chunk]


def _take_parent(open_: deque[Member], stripe: int, usable: Callable[[str], bool],
                 avoid: Collection[str]) -> str | None:
    while open_ and (open_[0].slots.get(stripe, 0) <= 0 or not usable(open_[0].name)):
        open_.popleft()
    for i, m in enumerate(open_):
        if m.name in avoid or not usable(m.name) or m.slots.get(stripe, 0) <= 0:
            continue
        m.slots[stripe] -= 1
        if m.slots[stripe] == 0:
            del open_[i]
        return m.name
    return None
