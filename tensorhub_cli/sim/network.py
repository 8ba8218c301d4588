"""The flow-level network: links with a rate, flows along paths of links, max-min fair
shares between them.

Protocol: ``link(rate)`` adds a link (bytes/s, one direction) and returns its id;
``start(path, nbytes, on_done)`` starts a flow over those links and calls
``on_done()`` when its last byte is through; ``stop(fid)`` ends a flow early (its
holder died). Rates are max-min fair (``max_min``, progressive filling): every flow
gets the same share of a link unless it is held to less elsewhere, and what it leaves
goes to the others. There is no packet, window or latency here: only rates.

Rates are recomputed after flows start or stop, once per instant (a ``late`` event,
after everything else that instant did). Recomputing for thousands of flows at every
chunk is where a 1,024-GPU run would spend its time, so with ``quantum_frac`` > 0 a
recomputation waits until ``quantum_frac`` of a typical chunk's transfer time (at the
rates of the last one), or ``quantum_s``, has passed since the previous one: a flow
started in between moves nothing until then (the flows already running keep their
rates), and a finished flow's share stays idle. A link never carries more than its
rate, so the network as a whole is never early; a single chunk may end early or late
by about that fraction. ``quantum_frac`` = ``quantum_s`` = 0 is exact.
"""

from __future__ import annotations

import heapq
from typing import Callable, Mapping, Sequence

from .events import Loop


def max_min(flows: Mapping[int, Sequence[int]], cap: Sequence[float]) -> dict[int, float]:
    """Max-min fair rates of ``flows`` (id → the link ids it crosses) over links of
    capacity ``cap[link]``, by progressive filling: the link with the smallest fair
    share (capacity left ÷ flows not yet fixed) fixes its flows at that share, which
    leaves the other links they cross; repeat. A link's share only grows as flows are
    fixed elsewhere, so a stale heap entry is simply pushed again."""
    rem: dict[int, float] = {}
    members: dict[int, list[int]] = {}
    for fid, path in flows.items():
        for link in path:
            m = members.get(link)
            if m is None:
                members[link] = [fid]
                rem[link] = cap[link]
            else:
                m.append(fid)
    cnt = {link: len(m) for link, m in members.items()}
    heap = [(rem[link] / n, link) for link, n in cnt.items()]
    heapq.heapify(heap)
    rate: dict[int, float] = {}
    pop, push = heapq.heappop, heapq.heappush
    while heap:
        share, link = pop(heap)
        n = cnt[link]
        if not n:
            continue
        cur = rem[link] / n
        if cur > share * (1 + 1e-9):
            push(heap, (cur, link))
            continue
        cur = max(cur, 0.0)
        for fid in members[link]:
            if fid in rate:
                continue
            rate[fid] = cur
            for m in flows[fid]:
                rem[m] -= cur
                cnt[m] -= 1
    return rate


class _Flow:
    __slots__ = ("path", "size", "left", "rate", "since", "epoch", "on_done")

    def __init__(self, path: tuple[int, ...], nbytes: float, now: float, on_done: Callable[[], None]):
        self.path, self.size, self.left, self.rate, self.since = path, nbytes, float(nbytes), 0.0, now
        self.epoch = 0
        self.on_done = on_done


class Network:
    def __init__(self, loop: Loop, quantum_s: float = 0.0, quantum_frac: float = 0.0):
        self.loop = loop
        self.cap: list[float] = []
        self.flows: dict[int, _Flow] = {}
        self.quantum_s, self.quantum_frac = quantum_s, quantum_frac
        self._next_fid = 0
        self._scheduled = False
        self._last = -float("inf")
        self._delta = quantum_s
        self.recomputes = 0
        self.bytes_done = 0.0

    def link(self, bytes_per_s: float) -> int:
        if not bytes_per_s > 0:
            raise ValueError(f"a link's rate must be positive, got {bytes_per_s}")
        self.cap.append(float(bytes_per_s))
        return len(self.cap) - 1

    def start(self, path: Sequence[int], nbytes: float, on_done: Callable[[], None]) -> int:
        if not path:
            raise ValueError("a flow needs at least one link")
        self._next_fid += 1
        self.flows[self._next_fid] = _Flow(tuple(path), nbytes, self.loop.now, on_done)
        self._touch()
        return self._next_fid

    def stop(self, fid: int) -> float:
        """End flow ``fid`` now (no ``on_done``); returns the bytes it had moved."""
        f = self.flows.pop(fid, None)
        if f is None:
            return 0.0
        self._touch()
        return f.size - (f.left - f.rate * (self.loop.now - f.since))

    def rate(self, fid: int) -> float:
        f = self.flows.get(fid)
        return f.rate if f is not None else 0.0

    def _touch(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        self.loop.at(max(self.loop.now, self._last + self._delta), self._recompute, late=True)

    def _recompute(self) -> None:
        self._scheduled = False
        now = self.loop.now
        self._last = now
        self.recomputes += 1
        flows = self.flows
        rates = max_min({fid: f.path for fid, f in flows.items()}, self.cap)
        at, finish = self.loop.at, self._finish
        sizes = total_rate = 0.0
        for fid, f in flows.items():
            new = rates[fid]
            sizes += f.size
            total_rate += new
            if new == f.rate:
                continue
            f.left -= f.rate * (now - f.since)
            f.since, f.rate = now, new
            f.epoch += 1
            if new > 0:
                at(now + max(f.left, 0.0) / new, finish, fid, f.epoch)
        if self.quantum_frac and total_rate > 0:
            # a typical chunk's time at the typical rate, so the error stays a fraction of it
            self._delta = max(self.quantum_s, self.quantum_frac * sizes / total_rate)

    def _finish(self, fid: int, epoch: int) -> None:
        f = self.flows.get(fid)
        if f is None or f.epoch != epoch:
            return  # stopped, or its rate changed since this finish was scheduled
        del self.flows[fid]
        self.bytes_done += f.size
        self._touch()
        f.on_done()
