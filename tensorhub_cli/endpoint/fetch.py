"""The reader's transfer loop: plan, read from many holders at once, verify, report.

Protocol (one ``Fetch`` per replica being filled, on the caller's thread):

1. Ask the hub for a ``Plan``: every read outstanding for us, old and new, up to the
   window. Reads we are not running yet start at once, one engine read per chunk,
   straight into the destination memory. A read the hub no longer lists (its source
   expired, so the hub re-planned the chunk) is abandoned for the new one.
2. Poll the reads. A finished chunk is checksum-verified (contract 5) before it counts:
   a match makes us a holder of it; a mismatch, an engine failure or a read older than
   ``read_timeout`` goes back to the hub as failed, and the hub re-plans it elsewhere.
3. Report verified and failed chunks in one ``Progress`` at most 50 ms after the first
   of them finished, then plan again. Done when every chunk is verified.

The hub's errors end the fetch (``unavailable``, ``not_found``, ``draining``) with a
``FetchError``; an unreachable hub is retried until the deadline, as the endpoint's
service thread re-registers us (and our reads in flight) with a restarted hub.
"""

from __future__ import annotations

import logging
import time

from ..engines import wire
from ..engines.base import EngineError, Pair
from ..hub import protocol as p
from ..hub.client import HubError, HubUnreachable
from .replica import Held

log = logging.getLogger("tensorhub.fetch")
REPORT_S = 0.05


class FetchError(RuntimeError):
    pass


class Fetch:
    def __init__(self, ep, held: Held, deadline: float, window: int, read_timeout: float):
        self.ep = ep
        self.held = held
        self.deadline = deadline
        self.window = window
        self.read_timeout = read_timeout
        self.inflight: dict[int, tuple[str, object, object, float]] = {}  # chunk -> (source, engine, xfer, t0)
        self.done: list[int] = []
        self.failed: list[p.Read] = []
        self.first_result = 0.0
        self.peers: dict[str, tuple[object, object, wire.Described]] = {}  # source -> (engine, peer, described)
        self.stats = {"bytes": 0, "reads": 0, "corrupt": 0, "failed": 0}
        self.starts = held.starts()
        self.backoff = 0.0
        self.warned: set[str] = set()

    # --- the loop --------------------------------------------------------------------

    def run(self) -> None:
        total = len(self.held.placed.views)
        plan_due = True
        last_plan = 0.0
        idle = 0.0002
        while True:
            now = time.monotonic()
            if now > self.deadline:
                raise FetchError(f"timed out with {len(self.held.held)}/{total} chunks verified")
            if (self.done or self.failed) and (now - self.first_result >= REPORT_S or not self.inflight):
                only_failures = not self.done
                self._report()
                plan_due = True
                # Reads that only fail (a dying source the hub has not expired yet, the
                # last holder of a chunk turning out corrupt) are retried with backoff,
                # not in a hot loop against the hub and the source.
                self.backoff = min(max(0.01, self.backoff * 2), 0.5) if only_failures else 0.0
                if self.backoff:
                    time.sleep(min(self.backoff, max(0.0, self.deadline - time.monotonic())))
            if plan_due and len(self.inflight) < self.window:
                if self._plan():
                    return
                plan_due = False
                last_plan = time.monotonic()
            progressed = self._poll()
            if progressed:
                idle = 0.0002
                continue
            if not self.inflight and not self.done and not self.failed:
                # Nothing to read yet (sources busy, a seed filling beyond a DC link):
                # ask again soon, backing off to 50 ms.
                if time.monotonic() - last_plan >= idle:
                    plan_due = True
                idle = min(idle * 2, 0.05)
                time.sleep(idle)
            else:
                time.sleep(idle)
                idle = min(idle * 1.5, 0.002)

    def _call(self, op):
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise FetchError("timed out waiting for the hub")
            try:
                return self.ep._call(op, timeout=min(5.0, left))
            except HubUnreachable:
                continue  # the service thread re-registers us when the hub is back
            except HubError as exc:
                if exc.code == "unknown_endpoint":
                    self.ep._await_registered(min(5.0, left))
                    continue
                raise FetchError(f"hub refused {type(op).__name__.lower()} of "
                                 f"{self.held.model}@{self.held.version}: {exc}") from None

    def _plan(self) -> bool:
        h = self.held
        planned = self._call(p.Plan(name=self.ep.name, model=h.model, version=h.version, window=self.window))
        if planned.complete:
            return True
        listed = {r.chunk: r.source for r in planned.reads}
        for chunk, (source, *_rest) in list(self.inflight.items()):
            if listed.get(chunk) != source:
                self._abandon(chunk)  # the hub re-planned it: its source is gone
        sources = {s.name: s for s in planned.sources}
        unreported = {r.chunk for r in self.failed}
        for read in planned.reads:
            if read.chunk in self.inflight or read.chunk in h.held or read.chunk in unreported:
                continue
            self._start(read, sources.get(read.source))
        return False

    def _start(self, read: p.Read, source: p.Source | None) -> None:
        h = self.held
        try:
            if source is None:
                raise EngineError(f"hub named source {read.source} without its address")
            engine, peer, desc = self._peer(source)
            i = read.chunk - (self.starts[desc.rank] if desc.rank >= 0 else 0)
            if not 0 <= i < len(desc.addrs):
                raise EngineError(f"{read.source} has no memory for chunk {read.chunk}")
            view = h.placed.views[read.chunk]
            xfer = engine.read(peer, [Pair(desc.addrs[i], view.data_ptr(), view.nbytes)], h.placed.device)
        except (EngineError, wire.PeerError) as exc:
            self._warn(read.source, f"read of chunk {read.chunk} from {read.source} failed to start: {exc}")
            self.peers.pop(read.source, None)
            self._fail(read.chunk, read.source)
            return
        with h.lock:
            h.reading[read.chunk] = read.source
        self.inflight[read.chunk] = (read.source, engine, xfer, time.monotonic())

    def _peer(self, source: p.Source):
        known = self.peers.get(source.name)
        if known is None:
            h = self.held
            address = source.engine_meta.decode()
            desc = wire.describe(address, self.ep._token, h.model, h.version, timeout=5.0, source=self.ep.host)
            engine = self.ep.engine if desc.engine == self.ep.engine.kind else self.ep.tcp
            known = self.peers[source.name] = (engine, engine.add_peer(address, desc.description), desc)
        return known

    def _poll(self) -> bool:
        progressed = False
        now = time.monotonic()
        for chunk, (source, engine, xfer, t0) in list(self.inflight.items()):
            state = engine.state(xfer)
            if state == "pending":
                if now - t0 > self.read_timeout:
                    self._warn(source, f"read of chunk {chunk} from {source} timed out after {now - t0:.1f}s")
                    self._abandon(chunk)
                    self._fail(chunk, source)
                    progressed = True
                continue
            progressed = True
            self._finish(chunk)
            if state == "failed":
                self.peers.pop(source, None)
                self._fail(chunk, source)
            elif self.held.placed.checksum(chunk) != self.held.expected(chunk).checksum:
                self._warn(source, f"chunk {chunk} from {source} failed its checksum; re-planning it")
                self.stats["corrupt"] += 1
                self._fail(chunk, source)
            else:
                self.held.placed.finish(chunk)
                with self.held.lock:
                    self.held.held.add(chunk)
                self.stats["bytes"] += self.held.placed.views[chunk].nbytes
                self.stats["reads"] += 1
                self._result()
                self.done.append(chunk)
        return progressed

    def _warn(self, source: str, message: str) -> None:
        """The first failure per source is a warning; its repeats are debug noise."""
        if source in self.warned:
            log.debug("%s", message)
        else:
            self.warned.add(source)
            log.warning("%s", message)

    def _finish(self, chunk: int) -> None:
        _source, engine, xfer, _t0 = self.inflight.pop(chunk)
        if not engine.release(xfer):
            self.ep._zombies.append((engine, xfer))
        with self.held.lock:
            self.held.reading.pop(chunk, None)

    def _abandon(self, chunk: int) -> None:
        self._finish(chunk)

    def _fail(self, chunk: int, source: str) -> None:
        self.stats["failed"] += 1
        self._result()
        self.failed.append(p.Read(chunk=chunk, source=source))

    def _result(self) -> None:
        if not self.done and not self.failed:
            self.first_result = time.monotonic()

    def _report(self) -> None:
        h = self.held
        done, failed = self.done, self.failed
        self.done, self.failed = [], []
        self._call(p.Progress(name=self.ep.name, model=h.model, version=h.version, chunks=done, failed=failed))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every read in flight (bounded), so the hub's Cancel may follow."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            for chunk, (_s, engine, xfer, _t) in list(self.inflight.items()):
                if engine.state(xfer) != "pending" or time.monotonic() >= deadline - 0.01:
                    self._finish(chunk)
            time.sleep(0.001)
