"""The reader's algorithm, once, without I/O: one table of chunk states, driven by
events, answering with actions. Whoever moves the bytes drives it: the simulator's
reader (``sim/endpoint.py``) today; the real fetch is to follow (docs/design.md,
"Schedules").

Protocol. ``Reader(wanted, ...)`` then, whenever something happens, ``step(now,
events)`` → actions, which the driver carries out and whose outcomes come back as
events. Between events the driver sleeps until ``wake_at`` (a timeout or a report
falling due): nothing here polls. The first step asks the hub (``Ask``: a ``Plan``
with ``schedule``), whose answer (``Answer``) names a source for every chunk it can.

A chunk is in exactly one state:

- ``WANTED``: needed, no source yet (asked for again with the next report);
- ``WAITING``: its source will hold it but does not yet: an ``Await`` on that source
  (one at a time per source, covering all its chunks we wait for) ends in ``Noticed``;
- ``READY``: its source holds it; ``Start`` once the window has room;
- ``READING``: its transfer runs; ``Landed`` ends it (ok or not);
- ``VERIFYING``: landed, its checksum runs (``Verify`` → ``Checked``);
- ``HELD``: verified (contract 5): ours, and served to others; ``PASSED`` the same
  for a chunk read in part (another layout);
- ``STOPPING``: given up while the transfer may still write our memory (a timeout, or
  the hub moved the chunk): ``Stop`` asked the engine, ``Stopped`` confirms; until then
  the chunk is neither read again nor reported (contract 3).

Results go to the hub in batches: once ``report_every`` chunks are verified, at once
for a failure (so the hub re-parents the chunk), and when nothing else is in flight.
The answer to a report is the reads still outstanding; the reader is done when the
hub answers ``complete``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hub.registry import bits

WANTED, WAITING, READY, READING, VERIFYING, HELD, PASSED, STOPPING = (
    "wanted", "waiting", "ready", "reading", "verifying", "held", "passed", "stopping")


# --- events -------------------------------------------------------------------------
@dataclass(slots=True)
class Answer:
    reads: list  # of (chunk, source, ready, tiled)
    complete: bool = False
    first: int = 0  # read from this chunk on, ascending, wrapping round (``Planned.first``)
    serial: bool = False  # one read at a time (``Planned.serial``: we head a chain)


@dataclass(slots=True)
class Refused:
    """The hub refused the plan (a ``FetchError`` for the driver)."""
    message: str


@dataclass(slots=True)
class Noticed:
    source: str
    chunks: int  # those of the awaited chunks the source holds now (0: the wait timed out)


@dataclass(slots=True)
class AwaitFailed:
    source: str  # gone, or it refused (it dropped the version): its chunks are failed reads


@dataclass(slots=True)
class Landed:
    chunk: int
    ok: bool


@dataclass(slots=True)
class Checked:
    chunk: int
    ok: bool
    tiled: bool = False  # verified in part (another layout): held as tiles, not whole


@dataclass(slots=True)
class Stopped:
    chunk: int


# --- actions ------------------------------------------------------------------------
@dataclass(slots=True)
class Ask:
    done: list[int]
    failed: list[tuple[int, str]]
    tiled: list[int]


@dataclass(slots=True)
class Await:
    source: str
    chunks: int


@dataclass(slots=True)
class Start:
    chunk: int
    source: str
    tiled: bool = False  # read the source's tiles as they lie (``Read.tiled``)


@dataclass(slots=True)
class Verify:
    chunk: int
    source: str


@dataclass(slots=True)
class Stop:
    chunk: int


@dataclass(slots=True)
class Done:
    pass


@dataclass(slots=True)
class Failed:
    message: str


def batch(n: int) -> int:
    """Verified chunks per progress report for a reader of ``n`` chunks: half of them
    (at least 8). The hub needs our progress only coarsely: children learn of our chunks
    from our notices, not from it, and what it does per report is per report and per
    chunk reported; a report per half cost the simulated hub at 1,024 rollout GPUs 0.67
    x the CPU of one per quarter, for the same time per version (docs/design.md)."""
    return max(8, n // 2)


@dataclass
class Reader:
    wanted: int  # bitset of the chunks to read
    window: int = 4  # transfers at once
    # ... and at once from one relay (a source scheduled to hold chunks it did not yet:
    # a tree parent): a chunk is relayed only once it has landed whole, so a reader
    # spreading its window over one parent's chunks makes each land later (its flows
    # share the parent's link), and every level of a tree adds that. Holders that had
    # our chunks when scheduled (publishers, complete replicas) take the whole window.
    per_source: int = 1
    report_every: int = 0  # verified chunks per progress report (0: ``batch``)
    read_timeout: float = 30.0  # one transfer
    wait_timeout: float = 120.0  # one chunk waiting on its source's notice
    state: dict[int, str] = field(default_factory=dict)
    by: dict[str, set[int]] = field(default_factory=dict)  # state -> its chunks (the same table, indexed)
    source: dict[int, str] = field(default_factory=dict)
    since: dict[int, float] = field(default_factory=dict)  # when the chunk entered its state
    tiled: set[int] = field(default_factory=set)  # scheduled onto a holder's tiles
    done: list[int] = field(default_factory=list)  # verified, not reported yet
    passed: list[int] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)
    awaiting: set[str] = field(default_factory=set)  # sources with an Await outstanding
    relays: set[str] = field(default_factory=set)  # sources scheduled for a chunk they did not hold yet
    asked: bool = False
    over: bool = False
    first: int = 0  # the hub's ``Planned.first``: where our reading order starts
    serial: bool = False  # the hub's ``Planned.serial``: a window of one
    wake_at: float = float("inf")
    asks: int = 0
    # Asking again for chunks nobody could feed yet (a version still assembling, every
    # holder of a chunk lost): the one paced ask, backing off while answers add nothing.
    idle_s: float = 0.0
    ask_at: float = 0.0

    def __post_init__(self) -> None:
        self.report_every = self.report_every or batch(self.wanted.bit_count())
        self.by = {s: set() for s in (WANTED, WAITING, READY, READING, VERIFYING, HELD, PASSED, STOPPING)}
        for c in bits(self.wanted):
            self.state[c] = WANTED
            self.by[WANTED].add(c)

    # --- the one entry point ------------------------------------------------------------
    def step(self, now: float, events=()) -> list:
        out: list = []
        if self.over:
            return out
        for ev in events:
            self._on(now, ev, out)
            if self.over:
                return out
        self._timeouts(now, out)
        self._start(now, out)
        self._await(out)
        self._report(now, out)
        self._wake()
        return out

    def count(self, state: str) -> int:
        return len(self.by[state])

    # --- events -------------------------------------------------------------------------
    def _on(self, now: float, ev, out: list) -> None:
        if isinstance(ev, Answer):
            self.asked = False
            if ev.complete:
                self.over = True
                out.append(Done())
                return
            before = len(self.by[WANTED])
            self.first, self.serial = ev.first, ev.serial
            self._answer(now, ev.reads, out)
            gained = len(self.by[WANTED]) < before
            self.idle_s = 0.0 if gained else min(max(0.005, self.idle_s * 2), 0.5)
            self.ask_at = now + self.idle_s
        elif isinstance(ev, Refused):
            self.over = True
            out.append(Failed(ev.message))
        elif isinstance(ev, Noticed):
            self.awaiting.discard(ev.source)
            for c in bits(ev.chunks):
                if self.state.get(c) == WAITING and self.source[c] == ev.source:
                    self._set(c, READY, now)
        elif isinstance(ev, AwaitFailed):
            self.awaiting.discard(ev.source)
            for c in [c for c in self.by[WAITING] if self.source[c] == ev.source]:
                self._fail(c, now)
        elif isinstance(ev, Landed):
            if self.state.get(ev.chunk) != READING:
                return
            if ev.ok:
                self._set(ev.chunk, VERIFYING, now)
                out.append(Verify(ev.chunk, self.source[ev.chunk]))
            else:
                self._fail(ev.chunk, now)
        elif isinstance(ev, Checked):
            if self.state.get(ev.chunk) != VERIFYING:
                return
            if not ev.ok:
                self._fail(ev.chunk, now)
            elif ev.tiled:
                self._set(ev.chunk, PASSED, now)
                self.passed.append(ev.chunk)
            else:
                self._set(ev.chunk, HELD, now)
                self.done.append(ev.chunk)
        elif isinstance(ev, Stopped):
            if self.state.get(ev.chunk) == STOPPING:
                self._fail(ev.chunk, now)

    def _answer(self, now: float, reads, out: list) -> None:
        listed = set()
        unreported = {c for c, _ in self.failed}
        for chunk, source, ready, tiled in reads:
            listed.add(chunk)
            st = self.state.get(chunk)
            if st is None or st in (HELD, PASSED, VERIFYING, STOPPING) or chunk in unreported:
                continue  # (a failure not reported yet: the answer to that report counts)
            if st == READING:
                if self.source[chunk] != source:  # the hub moved it: its source is gone
                    self._set(chunk, STOPPING, now)
                    out.append(Stop(chunk))
                continue
            if not ready:
                self.relays.add(source)
            moved = self.source.get(chunk) != source
            self.source[chunk] = source
            (self.tiled.add if tiled else self.tiled.discard)(chunk)
            if moved or st == WANTED:
                self._set(chunk, READY if ready else WAITING, now)
            elif ready and st == WAITING:
                self._set(chunk, READY, now)
            # (READY stays READY when the hub says "not yet": the source's notice is
            # newer than the hub's view, which hears of chunks in batches)
        for chunk in [c for c in (*self.by[WAITING], *self.by[READY]) if c not in listed]:
            self._set(chunk, WANTED, now)  # no longer scheduled (the hub dropped a lost source's read)

    # --- what to do next ----------------------------------------------------------------
    def _timeouts(self, now: float, out: list) -> None:
        for c in [c for c in self.by[READING] if now - self.since[c] > self.read_timeout]:
            self._set(c, STOPPING, now)
            out.append(Stop(c))
        for c in [c for c in self.by[WAITING] if now - self.since[c] > self.wait_timeout]:
            self._fail(c, now)  # its source fell behind: the hub re-parents it

    def _start(self, now: float, out: list) -> None:
        room = (1 if self.serial else self.window) - len(self.by[READING])
        if room <= 0 or not self.by[READY]:
            return
        # Spread over sources (fewest of our reads on it first), and from one source
        # lowest chunk first, counting from ``first``: every member of a chain reads in
        # the same order, so a child's next chunk is the one its parent verifies next;
        # a reader fed by many publishers does not queue on one of them at a time, and
        # chains side by side start on different publishers.
        busy: dict[str, int] = {}
        for c in self.by[READING]:
            busy[self.source[c]] = busy.get(self.source[c], 0) + 1
        ready = sorted(self.by[READY])
        first = self.first
        for _ in range(min(room, len(ready))):
            c = min(ready, key=lambda x: (busy.get(self.source[x], 0), x if x >= first else x + (1 << 62)))
            if self.source[c] in self.relays and busy.get(self.source[c], 0) >= self.per_source:
                return
            ready.remove(c)
            busy[self.source[c]] = busy.get(self.source[c], 0) + 1
            self._set(c, READING, now)
            out.append(Start(c, self.source[c], c in self.tiled))

    def _await(self, out: list) -> None:
        want: dict[str, int] = {}
        for c in self.by[WAITING]:
            s = self.source[c]
            if s not in self.awaiting:
                want[s] = want.get(s, 0) | 1 << c
        for source, chunks in sorted(want.items()):
            self.awaiting.add(source)
            out.append(Await(source, chunks))

    def _report(self, now: float, out: list) -> None:
        if self.asked:
            return
        by = self.by
        results = len(self.done) + len(self.passed)
        moving = by[READING] or by[VERIFYING] or by[STOPPING] or by[READY]
        idle = not moving and not by[WAITING]
        # (Not per chunk while others wait on their sources: children hear of our chunks
        # from us, not from the hub, so the hub needs our progress in batches only.)
        due = (self.asks == 0 or self.failed or results >= self.report_every or results and idle
               or by[WANTED] and idle and now >= self.ask_at)
        if due:
            self.asked = True
            self.asks += 1
            out.append(Ask(self.done, self.failed, self.passed))
            self.done, self.failed, self.passed = [], [], []

    def _wake(self) -> None:
        at = float("inf")
        for c in self.by[READING]:
            at = min(at, self.since[c] + self.read_timeout)
        for c in self.by[WAITING]:
            at = min(at, self.since[c] + self.wait_timeout)
        if self.by[WANTED] and not self.asked:
            at = min(at, self.ask_at)
        self.wake_at = at

    def _set(self, chunk: int, st: str, now: float) -> None:
        self.by[self.state[chunk]].discard(chunk)
        self.state[chunk] = st
        self.by[st].add(chunk)
        self.since[chunk] = now

    def _fail(self, chunk: int, now: float) -> None:
        self.failed.append((chunk, self.source.get(chunk, "")))
        self._set(chunk, WANTED, now)

