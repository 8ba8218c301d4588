"""The scheduled fetch: ``endpoint.reader.Reader`` driven by real sockets and engines.

Protocol (one ``ScheduledFetch`` per replica being filled, on the caller's thread).
The core decides; this module carries out its actions and turns what happens into
its events, on one queue the fetch thread blocks on (until the core's ``wake_at`` or
the deadline): nothing here polls.

- ``Ask``: a ``Plan`` with ``schedule`` (carrying the verified and failed chunks),
  sent by one hub thread (the fetch's own socket); its reply is ``Answer``. A hub that
  restarted is waited for as the windowed loop does (``unknown_endpoint``: our
  re-registration; ``rebuilding``: again shortly); a reply lost past ``plan_timeout``
  is asked again (progress is idempotent); any other refusal ends the fetch.
- ``Start``: one engine read, as the windowed loop builds it (``Fetch._begin``); the
  engine's ``when_over`` puts its end on the queue (``Landed``).
- ``Verify``: the checksum on a verifier thread; its end is ``Checked``. A verified
  chunk is scattered, counted, and ``mark_held``: readers waiting on us hear of it.
- ``Await``: ``wire.await_chunks`` on the source (a thread per source waited on), or
  ``wire.await_fragments`` when the core reads fragments, on a connection kept per source
  for the fetch (``wire.Kept``): its answer is ``Noticed``; a refusal or a dead source,
  ``AwaitFailed``. A wait still out when the fetch ends is called off then
  (``KeptByHolder.close``): a source gone silent holds no thread past the fetch.
- ``Relay``: ``Replica.mark_landed``: readers waiting on us for fragments of the chunk hear
  of the bytes landed.
- Fragments: ``TH_RELAY_FRAGMENTS`` reads a chunk (``FRAGMENTS`` by default; 1: whole chunks
  only) where the core reads in fragments; a chunk read in part (tiles) or as a delta is
  read whole.
- ``Stop``: the engine is told to stop the read; ``Stopped`` once it confirms.
- ``Replan``: the hub pushed ``replan`` (it dropped a source of ours) to the service
  thread, which calls the replica's ``replan`` hook, set while this fetch runs.

A read the hub planned with a ``base`` (``hub.deltas``) whose base chunk we hold
verified is asked of its source as a delta (``delta_reads``) and is one more read in
flight to the core. A delta that cannot be asked, rebuilt, or whose rebuilt chunk fails
its checksum is read again in full: from the same source at once when the delta read
failed, through the core's re-plan when the checksum did; either way that chunk is
never asked as a delta again in this fetch.

``stop`` and ``unpinned`` (a failed fetch's clean-up) are the windowed loop's, over
the same records (``inflight``, ``stopping``, ``verifying``), with the core's
unreported results added.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor

from ..engines import wire
from ..engines.base import EngineError, Pair
from ..errors import FetchError
from ..hub import protocol as p
from ..hub.client import HubClient, HubError
from . import reader as core
from . import streams
from .fetch import Fetch
from .delta_reads import DeltaAsk, DeltaReads
from .inflight import Reading, Stopping, Verifying

log = logging.getLogger("tensorhub.fetch")

AWAIT_S = 20.0  # one wait on a source's notice (the holder caps it at 30 s); then asked again
WAIT_TIMEOUT_S = 120.0  # a chunk waiting this long on its source is re-planned (the source fell behind)
FRAGMENTS = 4  # reads per relayed chunk (docs/design.md, "Fragments": 4 MiB chunks on the testbed)


def fragments(environ=os.environ) -> int:
    """Reads per relayed chunk: ``TH_RELAY_FRAGMENTS`` (an integer from 1 to 64), else ``FRAGMENTS``."""
    raw = environ.get("TH_RELAY_FRAGMENTS")
    if raw is None or raw == "":
        return FRAGMENTS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise ValueError(f"TH_RELAY_FRAGMENTS must be an integer from 1 to 64, not {raw!r}")
    return n


class ScheduledFetch(Fetch):
    def __init__(self, *args, want: list[int] | None = None, **kwargs):
        """``want``: only these chunks (a collective member's stripe), else every chunk
        our layout needs."""
        super().__init__(*args, **kwargs)
        self.only = None if want is None else sum(1 << c for c in want)
        self.bases: dict[int, int] = {}  # chunk -> the version the hub would have it read against
        self.no_delta: set[int] = set()  # chunks whose delta failed: read in full from now on
        self.by_delta: set[int] = set()  # chunks whose latest landing was rebuilt from a delta
        self.deltas: DeltaReads | None = None  # made at the first delta read
        self.stats.update(delta_reads=0, delta_wire_bytes=0, delta_full=0, delta_failed=0,
                          early_fragments=0)  # fragments read from a source that had landed only part of the chunk

    def _loop(self) -> None:
        h = self.held
        wanted = (1 << len(h.placed.views)) - 1 if h.placed.wanted is None else sum(1 << c for c in h.placed.wanted)
        if self.only is not None:
            wanted &= self.only
        wanted &= ~sum(1 << c for c in (*h.held, *h.passed))
        views = h.placed.views
        self.core = core.Reader(wanted, window=self.window, read_timeout=self.read_timeout, wait_timeout=WAIT_TIMEOUT_S,
                                fragments=fragments(), size=lambda c: views[c].nbytes, whole=set(h.placed.parts))
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.sources: dict[str, p.Source] = {}
        self.asked = None
        hub = ThreadPoolExecutor(1, thread_name_prefix="th-plan")
        waits = ThreadPoolExecutor(8, thread_name_prefix="th-await")
        self._waits = waits
        self._kept = wire.KeptByHolder(self.ep.host)  # (the core has one Await out per source)
        self._ended = False
        self._hub = hub
        events: list = []
        h.replan = lambda: self.q.put(("replan",))
        try:
            while True:
                now = time.monotonic()
                self._tick(now)
                if now > self.deadline:
                    raise FetchError(f"timed out with {len(h.held) + len(h.passed)}/{h.wanted} chunks verified")
                if self.ep.service.fenced:
                    raise FetchError(self.ep.service.fenced)
                for action in self.core.step(now, events):
                    if self._act(action):
                        return
                wait = min(self.core.wake_at, self.deadline) - time.monotonic()
                events = []
                try:
                    events.append(self._event(self.q.get(timeout=max(0.0, min(wait, 3600.0)))))
                    while True:
                        events.append(self._event(self.q.get_nowait()))
                except queue.Empty:
                    pass
                events = [e for e in events if e is not None]
        finally:
            h.replan = None
            self._ended = True
            waits.shutdown(wait=False, cancel_futures=True)
            hub.shutdown(wait=False, cancel_futures=True)
            self._kept.close()  # (a wait still out on a silent source ends now, not in AWAIT_S)
            if self.deltas is not None:  # (a read still running copies nothing once released)
                self.deltas.close()

    # --- actions --------------------------------------------------------------------------
    def _act(self, a) -> bool:
        """Carry out one action; True once the fetch is done."""
        h = self.held
        if isinstance(a, core.Start):
            self.stats["early_fragments"] += a.chunk in self.core.frag.avail
            self._begin(a.chunk, a.source, a.tiled, a.at, a.nbytes)
        elif isinstance(a, core.Relay):
            h.mark_landed(a.chunk, a.nbytes)
        elif isinstance(a, core.Verify):
            self.verifying[a.chunk] = Verifying(a.source, self.ep.verifiers.submit(
                h.placed.check, a.chunk, h.expected(a.chunk)))
            self.verifying[a.chunk].digest.add_done_callback(lambda f, c=a.chunk: self.q.put(("checked", c)))
        elif isinstance(a, core.Await):
            self._waits.submit(self._await, a.source, a.chunks, a.after)
        elif isinstance(a, core.Stop):
            self._stop_read(a.chunk)
        elif isinstance(a, core.Ask):
            op = p.Plan(name=self.ep.name, model=h.model, version=h.version, window=self.window,
                        held=p.bitset(p.mask_of(a.done)) if a.done else b"",
                        failed=[p.Read(chunk=c, source=s) for c, s in a.failed],
                        incarnation=self.ep.incarnation, tiled=list(a.tiled), want=self._want(),
                        layout=h.placed.layout, schedule=True)
            self.asked = op
            self._hub.submit(self._plan, op)
        elif isinstance(a, core.Done):
            return True
        elif isinstance(a, core.Failed):
            raise FetchError(a.message)
        return False

    def _want(self) -> bytes:
        if self.only is None:
            return self.held.want()
        return p.bitset(self.only)

    def _begin(self, chunk: int, source_name: str, tiled: bool, at: int = 0, nbytes: int = 0) -> None:
        """Read ``chunk`` (or its fragment: ``nbytes`` from ``at``) from ``source_name``."""
        source = self.sources.get(source_name)
        read = p.Read(chunk=chunk, source=source_name, tiled=tiled)
        try:
            if source is None:
                raise EngineError(f"hub named source {source_name} without its address")
            if not tiled and not nbytes and self._begin_delta(chunk, source):
                return
            holder, pairs = self._pairs(read, source)
            if nbytes:  # a fragment of a whole chunk's one pair
                if len(pairs) != 1 or at + nbytes > pairs[0].nbytes:
                    raise EngineError(f"fragment [{at}, {at + nbytes}) of chunk {chunk}: not within one "
                                      f"read of {sum(x.nbytes for x in pairs)} bytes")
                pairs = [Pair(pairs[0].remote + at, pairs[0].local + at, nbytes)]
            xfer = holder.engine.read(holder.peer, pairs, self.held.placed.device,
                                      remote_device=holder.described.device)
        except (EngineError, wire.PeerError) as exc:
            self._warn(source_name, f"read of chunk {chunk} from {source_name} failed to start: {exc}")
            self.peers.pop(source_name, None)
            self.q.put(("landed", chunk, None, "failed"))
            return
        with self.held.lock:
            self.held.reading[chunk] = source_name
        self.inflight[chunk] = Reading(source_name, holder.engine, xfer, time.monotonic())
        self.publisher_read[chunk] = holder.described.rank >= 0
        holder.engine.when_over(xfer, lambda state, c=chunk, x=xfer: self.q.put(("landed", c, x, state)))

    def _begin_delta(self, chunk: int, source: p.Source) -> bool:
        """Start chunk's read as a delta if the hub gave it a base we hold it of; True if started."""
        h = self.held
        base = self.bases.get(chunk, -1)
        if base < 0 or chunk in self.no_delta or chunk in h.placed.parts:
            return False
        old = self.ep.replicas.held_chunk(h.model, base, chunk)
        into = h.placed.views[chunk]
        if old is None or into is None or old.nbytes != into.nbytes:
            return False
        desc = self._peer(source).described
        if self.deltas is None:
            self.deltas = DeltaReads(ThreadPoolExecutor(max(1, self.window), thread_name_prefix="th-delta"))
        ask = DeltaAsk(address=source.engine_meta.decode(), token=self.ep.token, model=h.model, version=h.version,
                       base=base, index=chunk - (self.starts[desc.rank] if desc.rank >= 0 else 0),
                       timeout=self.read_timeout, source=self.ep.host)
        xfer = self.deltas.start(ask, old, into)
        with h.lock:
            h.reading[chunk] = source.name
        self.inflight[chunk] = Reading(source.name, self.deltas, xfer, time.monotonic())
        self.publisher_read[chunk] = desc.rank >= 0
        self.stats["delta_reads"] += 1
        self.deltas.when_over(xfer, lambda state, c=chunk, x=xfer: self.q.put(("landed", c, x, state)))
        return True

    def _stop_read(self, chunk: int) -> None:
        reading = self.inflight.pop(chunk, None)
        if reading is None:
            self.q.put(("stopped", chunk))
            return
        self.stopping[chunk] = Stopping(reading.source, reading.engine, reading.xfer, report=False)
        if reading.engine.release(reading.xfer):
            self.q.put(("stopped", chunk))
        else:  # once the engine says it is over, it can be released for good
            reading.engine.when_over(reading.xfer, lambda state, c=chunk: self.q.put(("stopped", c)))

    # --- the threads that wait ----------------------------------------------------------------
    def run(self) -> None:
        """Until the hub says we hold everything (``_loop``)."""
        self._ticked = time.monotonic()
        try:
            self._loop()
        finally:
            self._tick(time.monotonic())

    def _plan(self, op: p.Plan) -> None:
        """On the hub thread, with a socket of its own (a zmq socket stays on one
        thread; one per plan, as plans are a handful per fetch): the plan's answer (or
        refusal) onto the queue."""
        client = self.ep.hub_client()
        try:
            self._plan_on(client, op)
        finally:
            client.close()

    def _plan_on(self, client: HubClient, op: p.Plan) -> None:
        while time.monotonic() < self.deadline:
            registrations = self.ep.service.registrations
            try:
                body = client.wait(client.send(op), max(0.05, min(self.plan_timeout,
                                                                            self.deadline - time.monotonic())))
            except HubError as exc:
                if exc.code == "unknown_endpoint":  # the hub restarted: our holdings re-register us
                    time.sleep(0.05)
                    self.ep.await_registered(max(0.1, min(self.plan_timeout, self.deadline - time.monotonic())))
                    continue
                if exc.code == "rebuilding":
                    time.sleep(min(0.1, max(0.0, self.deadline - time.monotonic())))
                    continue
                self.q.put(("refused", f"hub refused plan of {self.held.model}@{self.held.version}: {exc}"))
                return
            except Exception as exc:  # lost (timed out, or sent to a hub since restarted): again, same report
                if registrations == self.ep.service.registrations:
                    log.debug("plan of %s@%s unanswered (%s); asking again", self.held.model, self.held.version, exc)
                continue
            self.ep.heard()
            self.q.put(("answer", body))
            return
        self.q.put(("refused", "timed out waiting for the hub's plan"))

    def _await(self, source_name: str, chunks: int, after: dict | None) -> None:
        source = self.sources.get(source_name)
        left = self.deadline - time.monotonic()
        landed: dict[int, int] = {}
        kept = None
        try:
            if source is None:
                raise wire.PeerError(f"no address for {source_name}")
            address = source.engine_meta.decode()
            kept = self._kept.take(source_name, address)
            args = (address, self.ep.token, self.held.model, self.held.version, chunks,
                    max(0.0, min(AWAIT_S, left)), self.ep.host)
            if after is None:
                have = wire.await_chunks(*args, kept=kept)
            else:
                have, landed = wire.await_fragments(*args, after, kept=kept)
        except (wire.PeerError, OSError, ValueError) as exc:
            if kept is not None:
                self._kept.drop(kept)
            if self._ended:
                return  # (called off as the fetch ended: nobody reads the queue now)
            self._warn(source_name, f"waiting on {source_name} for chunks of {self.held.model}@"
                                    f"{self.held.version} failed: {exc}")
            self.q.put(("await_failed", source_name))
            return
        self._kept.put(source_name, kept)
        self.q.put(("noticed", source_name, have, landed))

    # --- events -------------------------------------------------------------------------------
    def _event(self, item):
        """A queued happening as the core's event (None: nothing for the core)."""
        kind = item[0]
        h = self.held
        if kind == "answer":
            planned: p.Planned = item[1]
            self.asked = None
            for s in planned.sources:
                self.sources[s.name] = s
            reads = planned.listed()
            with h.lock:
                for r in reads:
                    if r.chunk not in h.held and r.chunk not in h.passed:
                        h.reading.setdefault(r.chunk, r.source)
            self.bases.update((r.chunk, r.base) for r in reads)
            self.core.whole.update(r.chunk for r in reads if r.base >= 0)  # (a delta is read whole)
            return core.Answer([(r.chunk, r.source, r.ready, r.tiled) for r in reads], planned.complete,
                               planned.first, planned.serial)
        if kind == "refused":
            return core.Refused(item[1])
        if kind == "replan":
            return core.Replan()
        if kind == "noticed":
            return core.Noticed(item[1], item[2], item[3])
        if kind == "await_failed":
            return core.AwaitFailed(item[1])
        if kind == "landed":
            chunk, xfer, state = item[1], item[2], item[3]
            reading = self.inflight.get(chunk)
            if xfer is not None and (reading is None or reading.xfer is not xfer):
                return None  # a read given up on already (its Stop handles it)
            if reading is not None:
                self._finish(chunk)
            if reading is not None and reading.engine is self.deltas:
                if state == "failed":  # read it in full, from the same source, without the hub
                    self._warn(reading.source, f"delta of chunk {chunk} from {reading.source} failed "
                                               f"({xfer.error}); reading it in full")
                    self.stats["delta_failed"] += 1
                    self.no_delta.add(chunk)
                    self._begin(chunk, reading.source, False)
                    return None
                self.by_delta.add(chunk)
                self.stats["delta_wire_bytes"] += xfer.wire_bytes
                self.stats["delta_full"] += xfer.full
            else:
                self.by_delta.discard(chunk)
            if state == "failed":
                if reading is not None:
                    self.peers.pop(reading.source, None)
                self.stats["failed"] += 1
                self._unread(chunk)
                return core.Landed(chunk, False)
            return core.Landed(chunk, True)
        if kind == "checked":
            chunk = item[1]
            verifying = self.verifying.pop(chunk)
            if not verifying.digest.result():
                if chunk in self.by_delta:
                    self.no_delta.add(chunk)
                self._warn(verifying.source, f"chunk {chunk} from {verifying.source} failed its checksum; re-planning it")
                self.stats["corrupt"] += 1
                self._unread(chunk)
                return core.Checked(chunk, False)
            return core.Checked(chunk, True, self._verified(chunk, verifying.source))
        if kind == "stopped":
            chunk = item[1]
            stopping = self.stopping.pop(chunk, None)
            if stopping is not None and not stopping.engine.release(stopping.xfer):
                self.stopping[chunk] = stopping  # not over yet after all: wait for it again
                stopping.engine.when_over(stopping.xfer, lambda state, c=chunk: self.q.put(("stopped", c)))
                return None
            self._unread(chunk)
            return core.Stopped(chunk)
        raise AssertionError(f"unknown fetch event {kind!r}")

    def _verified(self, chunk: int, source: str) -> bool:
        """A chunk passed its checksum: scatter it, count it, hold it. True if read in part."""
        h = self.held
        placed = h.placed
        if placed.finish(chunk):
            h.written = streams.scattered(placed.device)
        tiled = chunk in placed.parts
        if tiled:
            with h.lock:
                h.passed.add(chunk)
                h.reading.pop(chunk, None)
        else:
            with h.lock:
                h.reading.pop(chunk, None)
            h.mark_held([chunk])
        nbytes = placed.read_bytes(chunk)
        self.stats["bytes"] += nbytes
        self.stats["reads"] += 1
        if self.publisher_read.pop(chunk, False):
            self.stats["from_publishers"] += nbytes
        return tiled

    def _unread(self, chunk: int) -> None:
        with self.held.lock:
            self.held.reading.pop(chunk, None)

    # --- after a failure ----------------------------------------------------------------------
    def unpinned(self) -> p.Progress:
        """As the windowed loop's: the reads that ended, with the core's unreported
        results and the plan in flight's (its reply may never come)."""
        h = self.held
        c = getattr(self, "core", None)
        done = list(c.done) if c else []
        tiled = list(c.passed) if c else []
        failed = [p.Read(chunk=x, source=s) for x, s in (c.failed if c else [])]
        failed += [p.Read(chunk=x, source=v.source) for x, v in self.verifying.items()]
        failed += self.failed
        if c:  # scheduled, not started (or between fragments): nothing of ours touches the source
            for x in (*c.by[core.WAITING], *c.by[core.READY], *c.frag.stalled):
                failed.append(p.Read(chunk=x, source=c.source[x]))
        if self.asked is not None:
            done += self.asked.chunks
            failed += self.asked.failed
            tiled += self.asked.tiled
        return p.Progress(name=self.ep.name, model=h.model, version=h.version, chunks=done, failed=failed,
                          incarnation=self.ep.incarnation, tiled=tiled, layout=h.placed.layout)
