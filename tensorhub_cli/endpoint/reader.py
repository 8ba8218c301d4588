"""The reader's algorithm, once, without I/O: one table of chunk states, driven by
events, answering with actions. Whoever moves the bytes drives it: the real fetch
(``endpoint.scheduled``) and the simulator's reader (``sim/reader.py``), so the
algorithm exists once (docs/design.md, "Schedules").

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
- ``READING``: its transfer runs; ``Landed`` ends it (ok or not). A chunk a child may
  be waiting for (we head a chain, or read it from a relay) is read in ``fragments``
  reads, one after another, from its first byte (``endpoint.fragments``): each fragment that lands is told to our
  children (``Relay``: the bytes landed so far, unverified) so they read it while we
  read the next, and a relay's fragments are read as it tells us of them (``Noticed``'s
  ``landed``). Between fragments the chunk stays ``READING`` (``stalled`` when its
  source has not landed the next fragment yet); every hop of a chain then lags a fragment,
  not a chunk. Only the whole chunk is verified, as before: a bad fragment fails it here
  and in every child that read it (contract 5 holds per chunk);
- ``VERIFYING``: landed, its checksum runs (``Verify`` → ``Checked``);
- ``HELD``: verified (contract 5): ours, and served to others; ``PASSED`` the same
  for a chunk read in part (another layout);
- ``STOPPING``: given up while the transfer may still write our memory (a timeout, or
  the hub moved the chunk): ``Stop`` asked the engine, ``Stopped`` confirms; until then
  the chunk is neither read again nor reported (contract 3).

Results go to the hub in batches: once ``report_every`` chunks are verified (by
default all: ``batch``), at once for a failure (so the hub re-parents the chunk) or a
``Replan`` (the hub dropped a source: its answer moves our reads from it, as a move
gives up a read in flight), and when nothing else is in flight.
The answer to a report is the reads still outstanding; the reader is done when the
hub answers ``complete``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hub.registry import bits
from .fragments import Fragments

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
    landed: dict = field(default_factory=dict)  # chunk -> bytes of it landed at the source (unverified)


@dataclass(slots=True)
class AwaitFailed:
    source: str  # gone, or it refused (it dropped the version): its chunks are failed reads


@dataclass(slots=True)
class Replan:
    """The hub dropped a source of ours (contract 6): ask now, not at the next report."""


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
    # Fragments: also end the wait once one of these chunks has more bytes landed at the
    # source than given here (None: only a chunk held ends it).
    after: dict | None = None


@dataclass(slots=True)
class Start:
    chunk: int
    source: str
    tiled: bool = False  # read the source's tiles as they lie (``Read.tiled``)
    at: int = 0  # a fragment: bytes [at, at + nbytes) of the chunk (nbytes 0: the whole chunk)
    nbytes: int = 0


@dataclass(slots=True)
class Relay:
    """Tell whoever waits on us that ``nbytes`` of ``chunk`` from its first byte are in
    our memory, unverified (0: none any more: its read failed and starts over)."""
    chunk: int
    nbytes: int


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
    """Verified chunks per progress report for a reader of ``n`` chunks: all of them,
    so a fetch reports once, at its end (and at once for a failure). The hub needs our
    progress only there: children learn of our chunks from our notices, not from it;
    operators see how far we are from our beats (``Heartbeat.filling``), which we send
    anyway; a drain of one of our sources now waits for our last report, not our last
    read from it, and in a chain the two end a fragment apart. A report half way cost
    the simulated hub at 4,096 rollout GPUs 0.73 CPU-s a version against 0.33 without
    (docs/design.md, "One report per fetch")."""
    return max(1, n)


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
    fragments: int = 1  # reads per chunk a child may wait for (1: whole chunks only)
    size: object = None  # chunk -> its bytes (needed with fragments > 1)
    whole: set[int] = field(default_factory=set)  # chunks the driver reads whole (a delta's)
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
    replan: bool = False  # a ``Replan`` came: the next report is due at once
    over: bool = False
    first: int = 0  # the hub's ``Planned.first``: where our reading order starts
    serial: bool = False  # the hub's ``Planned.serial``: a window of one
    wake_at: float = float("inf")
    asks: int = 0
    # Asking again for chunks nobody could feed yet (a version still assembling, every
    # holder of a chunk lost): the one paced ask, backing off while answers add nothing.
    idle_s: float = 0.0
    ask_at: float = 0.0
    frag: Fragments = field(init=False)  # the fragment bookkeeping of READING chunks

    def __post_init__(self) -> None:
        self.frag = Fragments(self.fragments, self.size, self.whole)
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
            avail = self.frag.avail
            for c in bits(ev.chunks):
                if self.source.get(c) == ev.source and self.state[c] in (WAITING, READY, READING):
                    avail.pop(c, None)
                    self._landing(c, now, out)
            for c, n in ev.landed.items():
                st = self.state.get(c)
                if self.source.get(c) != ev.source or n <= 0:
                    continue
                # (READY or READING without ``avail``: the source holds it all already)
                if st == WAITING or st in (READY, READING) and c in avail and n > avail[c]:
                    avail[c] = n
                    self._landing(c, now, out)
        elif isinstance(ev, AwaitFailed):
            self.awaiting.discard(ev.source)
            for c in [c for c in (*self.by[WAITING], *self.frag.stalled) if self.source[c] == ev.source]:
                self._fail(c, now, out)
        elif isinstance(ev, Landed):
            c = ev.chunk
            if self.state.get(c) != READING or c in self.frag.stalled:
                return
            if not ev.ok:
                self._fail(c, now, out)
            elif c in self.frag.fragment:
                got = self.frag.landed(c)
                out.append(Relay(c, got))
                if got >= self.size(c):
                    self._set(c, VERIFYING, now)
                    out.append(Verify(c, self.source[c]))
                else:
                    self._next_fragment(c, now, out)
            else:
                self._set(c, VERIFYING, now)
                out.append(Verify(c, self.source[c]))
        elif isinstance(ev, Checked):
            if self.state.get(ev.chunk) != VERIFYING:
                return
            if not ev.ok:
                self._fail(ev.chunk, now, out)
            elif ev.tiled:
                self._set(ev.chunk, PASSED, now)
                self.passed.append(ev.chunk)
            else:
                self._set(ev.chunk, HELD, now)
                self.frag.relayed.discard(ev.chunk)  # (held supersedes the bytes told)
                self.done.append(ev.chunk)
        elif isinstance(ev, Stopped):
            if self.state.get(ev.chunk) == STOPPING:
                self._fail(ev.chunk, now, out)
        elif isinstance(ev, Replan):
            self.replan = True  # (an ask in flight may predate the drop: the next one asks again)

    def _landing(self, c: int, now: float, out: list) -> None:
        """The source has more of ``c`` (``avail``: how much; absent: all of it)."""
        if self.state[c] == WAITING:
            self._set(c, READY, now)
        elif self.frag.resume(c):
            self._next_fragment(c, now, out)

    def _next_fragment(self, c: int, now: float, out: list) -> None:
        """``c`` is read in fragments and has none in flight: start the next, or wait
        (stalled) for the source to land it."""
        self.since[c] = now
        read = self.frag.next(c)
        if read is not None:
            out.append(Start(c, self.source[c], False, *read))

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
                    self._give_up(chunk, now, out)
                elif ready and chunk in self.frag.avail:  # the source holds all of it by now
                    del self.frag.avail[chunk]
                    self._landing(chunk, now, out)
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
            if ready:
                self.frag.avail.pop(chunk, None)
            # (READY stays READY when the hub says "not yet": the source's notice is
            # newer than the hub's view, which hears of chunks in batches)
        for chunk in [c for c in (*self.by[WAITING], *self.by[READY]) if c not in listed]:
            self._set(chunk, WANTED, now)  # no longer scheduled (the hub dropped a lost source's read)

    # --- what to do next ----------------------------------------------------------------
    def _timeouts(self, now: float, out: list) -> None:
        stalled = self.frag.stalled
        for c in [c for c in self.by[READING]
                  if c not in stalled and now - self.since[c] > self.frag.limit(c, self.read_timeout)]:
            self._give_up(c, now, out)
        for c in [c for c in (*self.by[WAITING], *stalled) if now - self.since[c] > self.wait_timeout]:
            self._fail(c, now, out)  # its source fell behind: the hub re-parents it

    def _give_up(self, c: int, now: float, out: list) -> None:
        """Stop reading ``c``: through ``STOPPING`` while a transfer may still write it."""
        if c in self.frag.stalled:  # between fragments: nothing of ours is running
            self._fail(c, now, out)
            return
        self._set(c, STOPPING, now)
        out.append(Stop(c))

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
            if self.frag.applies(c, tiled=c in self.tiled, waited_for=self.serial or self.source[c] in self.relays):
                self.frag.begin(c)
                self._next_fragment(c, now, out)
            else:
                out.append(Start(c, self.source[c], c in self.tiled))

    def _await(self, out: list) -> None:
        want: dict[str, int] = {}
        # Also every chunk its source has landed only part of (``avail``), read or not:
        # the notice of more comes while our fragment runs, not a round trip after it
        # lands, and one Await per source must cover every chunk we may soon need of it.
        for c in (*self.by[WAITING], *self.frag.partial()):
            s = self.source[c]
            if s not in self.awaiting:
                want[s] = want.get(s, 0) | 1 << c
        for source, chunks in sorted(want.items()):
            self.awaiting.add(source)
            after = None
            if self.fragments > 1:
                after = {c: self.frag.avail.get(c, 0) for c in bits(chunks) if c not in self.whole}
            out.append(Await(source, chunks, after))

    def _report(self, now: float, out: list) -> None:
        if self.asked:
            return
        by = self.by
        results = len(self.done) + len(self.passed)
        moving = by[READING] or by[VERIFYING] or by[STOPPING] or by[READY]
        idle = not moving and not by[WAITING]
        # (Not per chunk while others wait on their sources: children hear of our chunks
        # from us, not from the hub, so the hub needs our progress in batches only.)
        due = (self.asks == 0 or self.failed or self.replan or results >= self.report_every
               or results and idle or by[WANTED] and idle and now >= self.ask_at)
        if due:
            self.asked, self.replan = True, False
            self.asks += 1
            out.append(Ask(self.done, self.failed, self.passed))
            self.done, self.failed, self.passed = [], [], []

    def _wake(self) -> None:
        at = float("inf")
        for c in self.by[READING]:
            at = min(at, self.since[c] + (self.wait_timeout if c in self.frag.stalled
                                          else self.frag.limit(c, self.read_timeout)))
        for c in self.by[WAITING]:
            at = min(at, self.since[c] + self.wait_timeout)
        if self.by[WANTED] and not self.asked:
            at = min(at, self.ask_at)
        self.wake_at = at

    def _set(self, chunk: int, st: str, now: float) -> None:
        if self.state[chunk] == READING:
            self.frag.forget(chunk)
        if st not in (READY, READING):
            self.frag.avail.pop(chunk, None)
        self.by[self.state[chunk]].discard(chunk)
        self.state[chunk] = st
        self.by[st].add(chunk)
        self.since[chunk] = now

    def _fail(self, chunk: int, now: float, out: list) -> None:
        self.failed.append((chunk, self.source.get(chunk, "")))
        self._set(chunk, WANTED, now)
        if chunk in self.frag.relayed:  # its bytes here start over
            self.frag.relayed.discard(chunk)
            out.append(Relay(chunk, 0))

