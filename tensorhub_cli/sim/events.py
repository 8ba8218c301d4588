"""The discrete-event loop: simulated time, and callbacks ordered by it.

Protocol: ``at(t, fn, *args)`` schedules ``fn(*args)`` at simulated time ``t`` (never
before ``now``); ``run(until)`` pops events in order of (time, priority, insertion)
and sets ``now`` to each one's time before calling it. Ties keep insertion order, so a
run is a pure function of its inputs. ``late=True`` events run after every ordinary
event of the same instant: the network recomputes its rates there, once for all the
flows that instant started or stopped. A callback may schedule more events; nothing
here reads the wall clock.
"""

from __future__ import annotations

import heapq
from typing import Callable


class Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable, tuple]] = []
        self._seq = 0
        self.events = 0  # callbacks run so far (where a run's wall time goes)

    def at(self, t: float, fn: Callable, *args, late: bool = False) -> None:
        if t < self.now:
            t = self.now  # (float rounding in a caller's sum: never schedule into the past)
        self._seq += 1
        heapq.heappush(self._heap, (t, 1 if late else 0, self._seq, fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = float("inf"), stop: Callable[[], bool] | None = None) -> None:
        """Run events up to simulated time ``until``, or until ``stop()`` turns true
        (checked after each event)."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)
            if stop is not None and stop():
                return
        if until != float("inf") and self.now < until:
            self.now = until

    @property
    def pending(self) -> int:
        return len(self._heap)
