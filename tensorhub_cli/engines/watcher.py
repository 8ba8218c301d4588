"""Completion callbacks for engines whose transport has none: one watcher thread per engine.

Protocol. ``Watcher(check, name)``; ``watch(transfer, fn)`` calls ``fn(state)`` exactly
once, with ``"done"`` or ``"failed"``, once ``check([transfer])`` no longer says
``"pending"``: at once on the caller's thread when it already is, else on the watcher's
thread. ``check(transfers) -> states`` is the engine's (one call per round, so an
engine can take its lock once for all). ``fn`` must be quick; what it raises is logged.
``close(timeout)`` stops the thread after one last round (transfers over by then get
their callbacks; those still pending never do, and are counted in ``dropped``);
``watch`` after ``close`` raises ``EngineError``.

This is the one place a poll remains on the reader's data path, and why: NIXL's Python
API has no completion callback (``nixl_agent`` offers ``check_xfer_state`` and
``get_new_notifs``, both polls), and UCX only moves a request forward while someone
drives its worker's progress, which ``check_xfer_state`` does (unless NIXL's progress
thread runs: ``engines.nixl_progress``). So the thread checks the
watched transfers, backing off from ``FIRST_S`` (20 µs) doubling to ``MAX_S`` (1 ms; an
engine's ``watch_ceiling_s``)
while they stay pending (back to ``FIRST_S`` whenever one ends or a new one is watched),
and sleeps on its condition, with no timeout and no CPU, while nothing is watched.
``idle`` says it is asleep there and ``rounds`` counts its checks (tests read both).

Pace. An engine whose passive side must be progressed for peers to read our memory
(NIXL over UCX's TCP and shared-memory transports) has its watcher do that too:
``pace(every_s)`` makes the thread call ``serve`` (the engine's ``progress``) at least
every ``every_s`` (``None``: no longer), asleep in between; a round that checks our
own reads serves too when it is due, so the checks below (their times unchanged: a
check put off to the next serving would notice a fast read's end up to a pace late)
and the serving share their wakes. One thread wakes where two did (the endpoint's
service thread progressed on a 1 ms timer, the watcher checked on its own; docs/
design.md, "One progress driver"). ``served`` counts the ``serve`` calls.

Our own reads. Where the engine must be progressed (``serve`` given: NIXL over UCX's
TCP transport), our READs move only while our own worker is progressed too: UCX drains
the socket into our memory only then, and an undrained socket stops the holder. A check
progresses the worker, so while anything is watched the thread checks at least every
``max_s``, whatever the predictions below say. Measured on the testbed before this, a
bare pair of our engines (the holder paced at 1 ms, the reader in 4 MiB reads, four in
flight) read 128 MiB in 3.17–3.32 s against a raw stream's 2.24 s on the same link, and
in 2.25 s with it; an endpoint that serves was spared only because its pace progressed
the same worker.

Predicted ends. A fetch's reads share their links alike, so the watcher learns the
rate of the last ``SAMPLES`` transfers that ended (bytes, as ``watch`` is told them,
over the time from its watch to the last check that found it pending: never more than
it took, so a prediction errs early and corrects itself) and predicts each transfer's end at the fastest of
them (``expect``; an engine that cannot tell bytes gets the shortest duration). Until
a transfer is ``LEAD`` of its ``expect`` old it is not checked (nothing should have
ended; a quicker one is noticed late by at most that sleep); from then it is checked
every ``expect / FINE`` (at least ``FIRST_S``) until twice ``expect``, and with the
back-off as before after; with nothing learned yet, the back-off alone. A chunk read
a fragment at a time (``endpoint.reader``) makes many short reads, each the next one's
wait: the back-off alone, near its ceiling by then, noticed each a millisecond or more
after its end.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Callable, Optional

from .base import EngineError, State

FIRST_S = 20e-6
MAX_S = 1e-3
SAMPLES = 16  # transfers whose durations make ``expect``
LEAD = 0.85  # first check at this share of ``expect``
FINE = 64  # checks per ``expect`` from then until twice ``expect``
log = logging.getLogger("tensorhub.engine")

Check = Callable[[list], list]
Over = Callable[[State], None]


def deliver(fn: Over, state: State) -> None:
    """Call a completion callback; what it raises is logged, never the caller's problem."""
    try:
        fn(state)
    except Exception:
        log.exception("a transfer's completion callback raised")


class Watcher:
    def __init__(self, check: Check, name: str = "th-watch", *, first_s: float = FIRST_S, max_s: float = MAX_S,
                 serve: Optional[Callable[[], None]] = None):
        """``serve``: what ``pace`` calls (the engine's ``progress``); None: ``pace`` is refused."""
        self._check = check
        self._serve = serve
        self._pace: float | None = None  # serve at least this often (s); None: not at all
        self._name = name
        self._first_s, self._max_s = first_s, max_s
        self._cond = threading.Condition()
        self._watched: dict[int, tuple[object, Over, float, int]] = {}  # key -> (transfer, callback, at, bytes)
        self._took: collections.deque = collections.deque(maxlen=SAMPLES)  # (watched to last seen pending, bytes)
        self._seen: dict[int, float] = {}  # key -> when a check last found it pending (watcher thread only)
        self._keys = itertools.count()
        self._fresh = False  # a watch came in since the last round: start the back-off again
        self._repaced = False  # the pace changed since the last round: do not sleep on the old one
        self._closed = False
        self._thread: threading.Thread | None = None
        self.idle = False  # blocked on the condition, nothing watched, not paced (no timeout: no CPU)
        self.rounds = 0  # checks made by the thread
        self.served = 0  # ``serve`` calls made by the thread
        self.serve_failures = 0  # of them, those that raised
        self.dropped = 0  # watches still pending at close, never called back

    def watch(self, transfer: object, fn: Over, nbytes: int = 0) -> None:
        """``nbytes``: what the transfer moves, if the engine can tell (0: it cannot):
        its end is then predicted from the rate of the last ones (see the module)."""
        state = self._states([transfer])[0]
        if state != "pending":
            deliver(fn, state)
            return
        with self._cond:
            if self._closed:
                raise EngineError(f"{self._name}: the engine is closed")
            self._watched[next(self._keys)] = (transfer, fn, time.monotonic(), nbytes)
            self._fresh = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def pace(self, every_s: float | None) -> None:
        """Call ``serve`` from this thread at least every ``every_s`` from now on (None:
        stop). Once it returns the caller need not progress the engine itself; after
        ``close`` it does nothing (nothing is left to serve)."""
        with self._cond:
            if self._closed or every_s == self._pace:
                return
            if every_s is not None and (self._serve is None or not every_s > 0):
                raise EngineError(f"{self._name}: cannot serve every {every_s!r} s"
                                  + ("" if self._serve else " (this engine has nothing to serve)"))
            self._pace, self._repaced = every_s, True
            if every_s is not None and self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def _serve_once(self) -> None:
        """(A failing ``serve`` is logged once, not at every pace: ``serve_failures``
        counts them.)"""
        try:
            self._serve()
        except Exception:
            self.serve_failures += 1
            if self.serve_failures == 1:
                log.exception("%s: progressing the engine for its peers failed (logged once; "
                              "counted in serve_failures)", self._name)
        self.served += 1

    def _states(self, transfers: list) -> list:
        try:
            states = list(self._check(transfers))
            if len(states) != len(transfers):
                raise EngineError(f"{len(states)} states for {len(transfers)} transfers")
            return states
        except Exception:  # (a broken check must not hang its waiters: each is over, failed)
            log.exception("%s: checking transfers failed; reporting them failed", self._name)
            return ["failed"] * len(transfers)

    def _run(self) -> None:
        delay = self._first_s
        served = float("-inf")  # when ``serve`` last ran (this thread's clock)
        while True:
            with self._cond:
                while not self._watched and not self._closed and self._pace is None:
                    self.idle = True
                    self._cond.wait()
                self.idle = False
                last = self._closed
                if self._fresh:
                    delay, self._fresh = self._first_s, False
                batch = list(self._watched.items())
                pace, self._repaced = self._pace, False
            if pace is not None and not last and time.monotonic() - served >= pace:
                self._serve_once()
                served = time.monotonic()
            checked = time.monotonic()
            states = self._states([t for _, (t, *_) in batch]) if batch else []
            if batch or last:
                self.rounds += 1
            now = time.monotonic()
            over = [(key, fn, s) for (key, (_, fn, *_)), s in zip(batch, states) if s != "pending"]
            # A transfer's time is taken as of the last check that found it pending, not the
            # one that found it over: the short side, so a late notice never teaches the
            # watcher to sleep longer (which would make the next notice later still).
            self._took.extend((self._seen.pop(key, at) - at, n)
                              for (key, (_, _, at, n)), s in zip(batch, states) if s == "done")
            self._seen.update((key, checked) for (key, _), s in zip(batch, states) if s == "pending")
            with self._cond:
                for key, _, _ in over:
                    del self._watched[key]
                    self._seen.pop(key, None)
                if last:
                    self.dropped = len(self._watched)
                    self._watched.clear()
            for _, fn, state in over:
                deliver(fn, state)
            if last:
                if self.dropped:
                    log.warning("%s: closed with %d transfer(s) still pending, never called back",
                                self._name, self.dropped)
                return
            if over:
                delay = self._first_s
                continue
            wait = float("inf")
            if batch:
                wait, delay = self._next(now, [(at, n) for _, (_, _, at, n) in batch], delay)
            if batch and self._serve is not None:  # (our reads move only while checked: "Our own reads")
                wait = min(wait, self._max_s)
            if pace is not None:  # (the next serving is due then, if no check comes first)
                wait = min(wait, max(0.0, served + pace - time.monotonic()))
            with self._cond:
                if not self._fresh and not self._repaced and not self._closed:
                    self._cond.wait(None if wait == float("inf") else wait)

    def _next(self, now: float, pending: list[tuple[float, int]], delay: float) -> tuple[float, float]:
        """(How long to sleep before the next check, the back-off delay after it) for
        ``pending`` (watched at, bytes), none over yet."""
        preds = [(at, self._predict(nbytes)) for at, nbytes in pending]
        if not preds or any(p is None for _, p in preds):  # (nothing learned: the back-off alone)
            return delay, min(delay * 2, self._max_s)
        fine = [p for at, p in preds if at + LEAD * p <= now < at + 2 * p]
        if fine:
            return max(self._first_s, min(fine) / FINE), self._first_s
        due = [at + LEAD * p - now for at, p in preds if now < at + LEAD * p]
        wait = min(due) if due else float("inf")
        if any(now >= at + 2 * p for at, p in preds):  # (late ones: the back-off, as before)
            return min(wait, delay), min(delay * 2, self._max_s)
        return wait, self._first_s

    def _predict(self, nbytes: int) -> float | None:
        """How long a transfer of ``nbytes`` (0: not told) should take, from the last
        ``SAMPLES``: at the fastest rate seen, or the shortest unsized one."""
        if nbytes > 0:
            rates = [n / took for took, n in self._took if n > 0 and took > 0]
            return nbytes / max(rates) if rates else None
        took = [t for t, n in self._took if n <= 0]
        return min(took) if took else None

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (after one last round) and wait up to ``timeout`` for it."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
