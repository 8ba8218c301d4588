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
(SplitStream's push-down), or laid out all at once from a muster's members
(``hub/mustering.py``, which today only sorts them by rack); not done.

Parallel chains (k = 1). A chain's tail lags its head by one chunk's transfer per
member, so a swarm of n members in one chain ends about n chunk times after its head:
at 4,096 rollout GPUs (128 members a swarm, 64 chunks each) 3.4 x the network bound
(``th bench sim --scale``). Where the roots can afford it, the swarm runs ``chains``
chains side by side instead, member j joining chain j mod ``chains`` behind its tail,
each chain's head fed by the roots: the hub sets ``chains`` when the swarm forms
(``hub/scheduling.py``: how many heads the publishers in the swarm's DC can feed at
full rate, from how much of each one's shard the swarm wants; one where a publisher's
shard is all of it, as a single trainer's is, or where none is in the DC, so a chunk
still crosses a DC link once).

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
    leads: bool = False  # it heads a chain: every stripe from the roots


@dataclass(slots=True)
class Swarm:
    """The readers of one version that want ``want`` in one DC."""

    dc: str
    want: int
    stripes: list[int]
    members: dict[str, Member] = field(default_factory=dict)
    # Per stripe: members with a free slot there, earliest first (breadth first).
    open: list[deque[Member]] = field(default_factory=list)
    # k = 1: chains side by side, and each one's tail (None: a head is still to come)
    chains: int = 1
    tails: list[str | None] = field(default_factory=list)
    starts: dict[int, int] = field(default_factory=dict)  # chain -> its first chunk (``Swarms.first``)
    local: bool = False  # its roots are in its DC (``Swarms.serial``)


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
             avoid: Collection[str] = (), chains: Callable[[], int] = lambda: 1,
             local: Callable[[], bool] = lambda: False) -> list[tuple[int, str | None]]:
        """``name`` joins the swarm of (dc, want): per stripe, the chunks and the tree
        parent that feeds them (None: the stripe goes to the roots). ``usable(parent)``
        says whether a parent may still feed anyone (alive, not draining): those that
        may not leave the swarm's open lists for good; ``avoid`` (parents that failed
        this reader) are passed over for this reader only. ``chains()``: how many
        chains a new swarm runs (k = 1), and ``local()`` whether its roots are in its
        DC, each asked once, when the swarm forms."""
        swarm = self.by_key.get((dc, want))
        if swarm is None:
            stripes = deal(want, self.k)
            n = max(1, chains()) if self.k == 1 else 1
            swarm = self.by_key[(dc, want)] = Swarm(dc, want, stripes, open=[deque() for _ in stripes],
                                                    chains=n, tails=[None] * n, local=local())
        if swarm.chains > 1:
            return [(swarm.stripes[0], self._chain(swarm, name, usable, avoid))]
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
        me = Member(name, index, slots, leads=all(parent is None for _, parent in out))
        swarm.members[name] = me
        for s in sorted(slots):
            swarm.open[s].append(me)
        self.of[name] = swarm
        return out

    def first(self, name: str) -> int:
        """Where ``name``'s reading order starts: chain c of C at the (c/C)-th of the
        swarm's wanted chunks, so the heads start on different publishers (0: one chain)."""
        swarm = self.of.get(name)
        if swarm is None or swarm.chains == 1:
            return 0
        me = swarm.members.get(name)
        c = me.index % swarm.chains if me is not None else 0
        if not c:
            return 0
        start = swarm.starts.get(c)
        if start is None:  # (once a chain: every plan of its members asks)
            at, rest = c * swarm.want.bit_count() // swarm.chains, swarm.want
            for _ in range(at):
                rest &= rest - 1
            start = swarm.starts[c] = (rest & -rest).bit_length() - 1 if rest else 0
        return start

    def serial(self, name: str) -> bool:
        """Whether ``name`` reads one chunk at a time: it heads a chain fed by roots in
        its DC. Its window's reads would share its link and land together a window's
        chunk times later, and its child, which takes each chunk as it lands, starts
        that much later (measured: a window of 4 cost the simulated chain 4 chunk times
        on its first hop, 1 on each other); one read at a time fills the link as well,
        each landing a chunk time after the last. Not across a DC link, where one read
        may not fill it."""
        swarm = self.of.get(name)
        if swarm is None or not swarm.local:
            return False
        me = swarm.members.get(name)
        return me is not None and me.leads

    def _chain(self, swarm: Swarm, name: str, usable: Callable[[str], bool], avoid: Collection[str]) -> str | None:
        """``name`` joins the next chain behind its tail (None: it heads that chain, fed
        by the roots); a tail that may not feed it (dead, draining, avoided) is skipped,
        and ``name`` takes its place: a chain never waits on a gone member."""
        c = len(swarm.members) % swarm.chains
        tail = swarm.tails[c]
        parent = tail if tail is not None and tail not in avoid and usable(tail) else None
        swarm.members[name] = Member(name, len(swarm.members), {}, leads=parent is None)
        swarm.tails[c] = name
        self.of[name] = swarm
        return parent

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
