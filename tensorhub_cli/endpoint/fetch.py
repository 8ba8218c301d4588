"""The windowed reader loop: plan a window, read from many holders at once, verify,
report. Fetches run ``endpoint/scheduled.py`` (one schedule per fetch, the reader core
of ``endpoint/reader.py``) unless the endpoint says otherwise (``TH_FETCH=window``,
``connect(schedule=False)``); ``ScheduledFetch`` reuses this class's records and
clean-up (``stop``, ``_pairs``, ``_peer``, ``_finish``).

Protocol (one ``Fetch`` per replica being filled, on the caller's thread):

1. Ask the hub for a ``Plan``: every read outstanding for us, old and new, up to the
   window (a reader of another layout asks only for the chunks its boxes touch,
   ``Replica.want``, and names its layout). Reads we are not running yet start at once,
   one engine read per chunk, straight into the destination memory, or, for a chunk
   we need only part of, one read of the tiles we need (a descriptor per row of
   strips: ``layout.overlap``), or of a same-layout holder's tiles as they lie. A read the hub no longer lists (its source
   expired, so the hub re-planned the chunk) is abandoned for the new one.
2. Poll the reads. A finished chunk is checksum-verified (contract 5), on a verifier
   thread so hashing overlaps the next reads, before it counts:
   a match makes us a holder of it (of a chunk read in part: ``tiled``, held for
   readers of our layout only, and scattered into the destination); a mismatch, an engine failure or a read older than
   ``read_timeout`` goes back to the hub as failed, and the hub re-plans it elsewhere.
   A read given up while its transfer is pending (timed out; re-planned by the hub)
   is told to stop, and is reported (which unpins it at its source) only once the
   engine confirms the transfer can no longer touch either buffer; until then it
   stays in flight for the hub, and its chunk is not read again (contract 3).
   A staged chunk's scatter into its tensors (async ``copy_``) records an event
   (``streams.scattered``) on the replica, before the chunk counts as held: the
   endpoint makes the caller's stream wait on the last one before ``fetch`` returns.
3. Report verified and failed chunks with the next ``Plan`` (it carries the progress)
   once half the window has finished, and at most 50 ms after the first of them did.
   Done when every chunk is verified. Plans go out without blocking: one is in flight
   at a time while reads go on, on the fetch's own hub socket. A plan that left window
   slots free (sources capped, or sending the chunk to another reader) is followed by
   another after 5 ms, doubling to 80 ms while plans grant nothing new
   (``_refill_later``): sources free up long before our own reads end.

The hub's errors end the fetch (``unavailable``, ``not_found``, ``draining``) with a
``FetchError``; a plan unanswered for ``plan_timeout`` is sent again (progress is
idempotent) until the deadline, as the endpoint's service thread re-registers us (and
our reads in flight) with a restarted hub.

Waits, all set per fetch by the endpoint: ``deadline`` (the whole fetch),
``read_timeout`` (one chunk read), ``plan_timeout`` (one plan round trip; also how long
a plan that met a restarted hub waits for our re-registration), ``describe_timeout``
(asking a holder where its chunks are), ``stop(timeout)`` (reads stopping after a
failure). ``report_s`` paces reports; it is no wait.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, wait

from ..engines import wire
from ..engines.base import EngineError, Pair
from ..errors import FetchError  # (defined with the rest of the public errors; importable from here)
from ..hub import protocol as p
from ..hub.client import HubError
from . import streams
from .inflight import Asked, Holder, Reading, Stopping, Verifying, Zombie
from .replica import Replica

log = logging.getLogger("tensorhub.fetch")

# A plan with nothing to read while nothing is in flight is asked again after IDLE_MIN_S,
# doubling up to IDLE_MAX_S. Free window slots are asked for again after REFILL_MIN_S,
# doubling up to REFILL_MAX_S while plans grant nothing new (``Fetch._refill_later``).
# (The simulator's reader, ``sim/endpoint.py``, paces itself by these too.)
IDLE_MIN_S, IDLE_MAX_S = 0.0002, 0.05
REFILL_MIN_S, REFILL_MAX_S = 0.005, 0.08


class Fetch:
    def __init__(self, ep, held: Replica, deadline: float, window: int, *, read_timeout: float,
                 plan_timeout: float, describe_timeout: float, report_s: float = 0.05):
        self.ep = ep
        self.held = held
        self.deadline = deadline
        self.window = window
        self.read_timeout = read_timeout
        self.plan_timeout = plan_timeout
        self.describe_timeout = describe_timeout
        self.report_s = report_s
        self.inflight: dict[int, Reading] = {}
        self.verifying: dict[int, Verifying] = {}
        self.stopping: dict[int, Stopping] = {}
        self.done: list[int] = []
        self.tiled: list[int] = []  # verified, read in part (another layout): reported, not held
        self.failed: list[p.Read] = []
        self.first_result = 0.0
        self.peers: dict[str, Holder] = {}  # by the hub's name for the holder
        # from_publishers: bytes read from a published shard (a trainer's send counter)
        self.stats = {"bytes": 0, "reads": 0, "corrupt": 0, "failed": 0, "from_publishers": 0}
        # The loop's wall time, split by what it was waiting on (``_tick``): reads in
        # flight (transfer), only checksums (verify), only the hub (plan wait). The
        # three sum to the loop's time; bytes move while plans and hashing overlap.
        self.times = {"plan_wait_s": 0.0, "transfer_s": 0.0, "verify_s": 0.0}
        self._ticked = 0.0
        self.publisher_read: dict[int, bool] = {}  # chunk -> its latest read is from a published shard
        self.starts = held.starts()
        self.backoff = 0.0
        self.refill_s, self.refill_at = REFILL_MIN_S, 0.0  # asking again for free window slots
        self.warned: set[str] = set()

    # --- the loop --------------------------------------------------------------------

    def run(self) -> None:
        """Until the hub says we hold everything. One plan request is in flight at a
        time, sent without waiting: reads already started keep moving (and verifying)
        while the hub answers."""
        self.client = self.ep.hub_client()
        self._ticked = time.monotonic()
        try:
            self._loop()
        finally:
            self._tick(time.monotonic())
            self.client.close()

    def _tick(self, now: float) -> None:
        """Charge the time since the last tick to what the loop was waiting on."""
        if self.inflight or self.stopping:
            key = "transfer_s"
        elif self.verifying:
            key = "verify_s"
        else:
            key = "plan_wait_s"
        self.times[key] += now - self._ticked
        self._ticked = now

    def _loop(self) -> None:
        total = self.held.wanted
        self.asked: Asked | None = None
        plan_due, idle = True, IDLE_MIN_S
        while True:
            now = time.monotonic()
            self._tick(now)
            if now > self.deadline:
                raise FetchError(f"timed out with {len(self.held.held) + len(self.held.passed)}/{total} chunks verified")
            if self.ep.service.fenced:  # a replaced process must not complete reads the hub gave away
                raise FetchError(self.ep.service.fenced)
            busy = len(self.inflight) + len(self.verifying) + len(self.stopping)
            results = len(self.done) + len(self.failed) + len(self.tiled)
            # Report (with the next plan) once half the window has results, so reads
            # keep flowing, and never sit on a result longer than report_s.
            if results and (2 * results >= self.window or now - self.first_result >= self.report_s or not busy):
                plan_due = True
            elif len(self.inflight) < self.window and now >= self.refill_at:
                plan_due = True  # free slots in the window: a source may have freed up since
            if self.asked is None and plan_due and (results or len(self.inflight) < self.window):
                self._ask()
                plan_due = False
            if self.asked is not None:
                planned = self._answer()
                if planned is None and self.asked is None:
                    plan_due = True  # the hub turned the plan away for now (restarted): ask again
                if planned is not None:
                    if planned.complete:
                        return
                    started = len(self.inflight)
                    self._start_planned(planned)
                    self._refill_later(now, started)
                    if not planned.reads and not busy:
                        # Nothing to read yet (sources busy, a seed filling beyond a DC
                        # link): ask again soon, backing off to 50 ms.
                        idle = min(idle * 2, IDLE_MAX_S)
                        time.sleep(idle)
                        plan_due = True
            if self._poll():
                idle = IDLE_MIN_S
            elif self.verifying and not self.inflight and self.asked is None:
                # Only hashing left to wait for: wake the moment a checksum is ready.
                wait([v.digest for v in self.verifying.values()], timeout=0.002, return_when=FIRST_COMPLETED)
            elif self.asked is not None and not self.inflight:
                self.client.reply_ready(0.002)  # nothing else to do: block briefly for the hub
            elif busy:
                time.sleep(min(idle, 0.0005))
                idle = min(idle * 1.5, 0.002)
            elif not self.asked:
                plan_due = True

    def _refill_later(self, now: float, started: int) -> None:
        """When to ask again for the window's free slots without a result to report.
        A plan that left slots free met busy sources (capped, or sending the chunk to
        another reader); they free up before our own reads end, so we ask again soon,
        backing off while plans keep granting nothing (the hub's load stays bounded:
        at most one plan per ``REFILL_MAX_S`` per idle-slotted reader)."""
        if len(self.inflight) > started:
            self.refill_s = REFILL_MIN_S
        else:
            self.refill_s = min(REFILL_MAX_S, self.refill_s * 2)
        self.refill_at = now + self.refill_s

    def _ask(self) -> None:
        h = self.held
        op = p.Plan(name=self.ep.name, model=h.model, version=h.version, window=self.window,
                    chunks=self.done, failed=self.failed, incarnation=self.ep.incarnation, want=h.want(),
                    tiled=self.tiled, layout=h.placed.layout)
        only_failures = self.failed and not self.done and not self.tiled
        self.done, self.failed, self.tiled = [], [], []
        # Reads that only fail (a dying source the hub has not expired yet, the last
        # holder of a chunk turning out corrupt) are retried with backoff, not in a hot
        # loop against the hub and the source.
        self.backoff = min(max(0.01, self.backoff * 2), 0.5) if only_failures else 0.0
        if self.backoff:
            time.sleep(min(self.backoff, max(0.0, self.deadline - time.monotonic())))
        self.asked = Asked(self.client.send(op), time.monotonic(), op, self.ep.service.registrations)

    def _answer(self) -> p.Planned | None:
        asked = self.asked
        try:
            planned = self.client.reply(asked.rid)
        except HubError as exc:
            self.asked = None
            if exc.code == "unknown_endpoint":  # the hub restarted: our holdings re-register us
                time.sleep(0.05)  # (the service thread may not have noticed yet)
                self.ep.await_registered(max(0.1, min(self.plan_timeout, self.deadline - time.monotonic())))
                return None
            if exc.code == "rebuilding":  # restarted hub, holders still re-registering: ask again
                time.sleep(min(0.1, max(0.0, self.deadline - time.monotonic())))
                return None
            raise FetchError(f"hub refused plan of {self.held.model}@{self.held.version}: {exc}") from None
        if planned is None:
            # Lost: past its timeout, or sent to a hub that has since restarted (we
            # registered again after sending it). Ask again with the same report.
            again = self.ep.service.registrations
            if time.monotonic() - asked.sent > self.plan_timeout or again != asked.registrations:
                self.asked = Asked(self.client.send(asked.op), time.monotonic(), asked.op, again)
            return None
        self.asked = None
        self.ep.heard()
        return planned

    def _start_planned(self, planned: p.Planned) -> None:
        h = self.held
        listed = {r.chunk: r.source for r in planned.reads}
        for chunk, reading in list(self.inflight.items()):
            if listed.get(chunk) != reading.source:
                self._abandon(chunk, report=False)  # the hub re-planned it: its source is gone
        sources = {s.name: s for s in planned.sources}
        unreported = {r.chunk for r in self.failed}
        for read in planned.reads:
            if read.chunk in self.inflight or read.chunk in self.verifying or read.chunk in h.held \
                    or read.chunk in h.passed or read.chunk in unreported or read.chunk in self.stopping:
                continue
            self._start(read, sources.get(read.source))

    def _pairs(self, read: p.Read, source: p.Source) -> tuple[Holder, list[Pair]]:
        """The holder of ``read`` (described once) and the descriptors that read it:
        the whole chunk, or (``read.tiled``) a same-layout holder's tiles as they lie,
        or, for a chunk we need only part of, one descriptor per row of strips."""
        h = self.held
        holder = self._peer(source)
        desc = holder.described
        i = read.chunk - (self.starts[desc.rank] if desc.rank >= 0 else 0)
        if not 0 <= i < len(desc.addrs):
            raise EngineError(f"{read.source} has no memory for chunk {read.chunk}")
        tiled = h.placed.parts.get(read.chunk)
        if read.tiled and tiled is None:
            raise EngineError(f"{read.source} holds only tiles of chunk {read.chunk}, and we need it whole")
        if tiled is None or read.tiled:
            view = h.placed.views[read.chunk]
            return holder, [Pair(desc.addrs[i], view.data_ptr(), view.nbytes)]
        return holder, [Pair(desc.addrs[i] + at, v.data_ptr(), v.nbytes) for at, v in tiled.pairs]

    def _start(self, read: p.Read, source: p.Source | None) -> None:
        h = self.held
        try:
            if source is None:
                raise EngineError(f"hub named source {read.source} without its address")
            holder, pairs = self._pairs(read, source)
            desc = holder.described
            # both devices named: NIXL matches descriptors by device id, and a
            # description that disagrees with the holder's answer is refused, not misread
            xfer = holder.engine.read(holder.peer, pairs, h.placed.device, remote_device=desc.device)
        except (EngineError, wire.PeerError) as exc:
            self._warn(read.source, f"read of chunk {read.chunk} from {read.source} failed to start: {exc}")
            self.peers.pop(read.source, None)
            self._fail(read.chunk, read.source)
            return
        with h.lock:
            h.reading[read.chunk] = read.source
        self.inflight[read.chunk] = Reading(read.source, holder.engine, xfer, time.monotonic())
        self.publisher_read[read.chunk] = desc.rank >= 0  # decided now: a failure elsewhere may drop the peer

    def _peer(self, source: p.Source) -> Holder:
        known = self.peers.get(source.name)
        if known is None:
            h = self.held
            address = source.engine_meta.decode()
            desc = wire.describe(address, self.ep.token, h.model, h.version, timeout=self.describe_timeout,
                                 source=self.ep.host)
            engine = self.ep.engine if desc.engine == self.ep.engine.kind else self.ep.tcp
            known = self.peers[source.name] = Holder(engine, engine.add_peer(address, desc.description), desc)
        return known

    def _poll(self) -> bool:
        progressed = False
        now = time.monotonic()
        for chunk, reading in list(self.inflight.items()):
            source = reading.source
            state = reading.engine.state(reading.xfer)
            if state == "pending":
                if now - reading.started > self.read_timeout:
                    self._warn(source, f"read of chunk {chunk} from {source} timed out after "
                                       f"{now - reading.started:.1f}s")
                    self._abandon(chunk, report=True)
                    progressed = True
                continue
            progressed = True
            self._finish(chunk)
            if state == "failed":
                self.peers.pop(source, None)
                self._fail(chunk, source)
            else:  # hashed on a verifier thread, while this one keeps moving bytes
                self.verifying[chunk] = Verifying(source, self.ep.verifiers.submit(
                    self.held.placed.check, chunk, self.held.expected(chunk)))
        for chunk, stopping in list(self.stopping.items()):
            if stopping.engine.release(stopping.xfer):
                progressed = True
                self._stopped(chunk)
        for chunk, verifying in list(self.verifying.items()):
            if not verifying.digest.done():
                continue
            progressed = True
            del self.verifying[chunk]
            source = verifying.source
            if not verifying.digest.result():
                self._warn(source, f"chunk {chunk} from {source} failed its checksum; re-planning it")
                self.stats["corrupt"] += 1
                self._fail(chunk, source)
                continue
            placed = self.held.placed
            if placed.finish(chunk):
                # async copies: the caller's stream waits for them (streams)
                self.held.written = streams.scattered(placed.device)
            in_part = chunk in placed.parts
            with self.held.lock:
                (self.held.passed if in_part else self.held.held).add(chunk)
            nbytes = placed.read_bytes(chunk)
            self.stats["bytes"] += nbytes
            self.stats["reads"] += 1
            if self.publisher_read.pop(chunk, False):
                self.stats["from_publishers"] += nbytes
            self._result()
            (self.tiled if in_part else self.done).append(chunk)
        return progressed

    def _warn(self, source: str, message: str) -> None:
        """The first failure per source is a warning; its repeats are debug noise."""
        if source in self.warned:
            log.debug("%s", message)
        else:
            self.warned.add(source)
            log.warning("%s", message)

    def _abandon(self, chunk: int, *, report: bool) -> None:
        """Give up a pending read: ask the engine to stop it. Its chunk and pin stay
        until the engine confirms (``_stopped``), at once or on a later poll."""
        reading = self.inflight.pop(chunk)
        self.stopping[chunk] = Stopping(reading.source, reading.engine, reading.xfer, report)
        if reading.engine.release(reading.xfer):
            self._stopped(chunk)

    def _stopped(self, chunk: int) -> None:
        stopping = self.stopping.pop(chunk)
        with self.held.lock:
            self.held.reading.pop(chunk, None)
        if stopping.report:
            self._fail(chunk, stopping.source)

    def _finish(self, chunk: int) -> None:
        """A read that ended (done or failed): no longer writing, whatever ``release`` says."""
        reading = self.inflight.pop(chunk)
        if not reading.engine.release(reading.xfer):
            self.ep.zombies.add(Zombie(reading.engine, reading.xfer))
        with self.held.lock:
            self.held.reading.pop(chunk, None)

    def _fail(self, chunk: int, source: str) -> None:
        self.stats["failed"] += 1
        self._result()
        self.failed.append(p.Read(chunk=chunk, source=source))

    def _result(self) -> None:
        if not self.done and not self.failed and not self.tiled:
            self.first_result = time.monotonic()

    def stop(self, timeout: float = 5.0) -> list[Zombie]:
        """Tell every read in flight to stop and wait up to ``timeout`` seconds for the
        engine to confirm each. Returns the reads it did not confirm, as zombies for the
        endpoint: they stay pinned at the hub until they end. The rest are ours no more:
        ``unpinned()`` lists what the hub may unpin now."""
        for chunk, reading in list(self.inflight.items()):
            if reading.engine.state(reading.xfer) == "pending":
                self._abandon(chunk, report=True)
            else:
                self._finish(chunk)
                self.failed.append(p.Read(chunk=chunk, source=reading.source))
        deadline = time.monotonic() + timeout
        while self.stopping and time.monotonic() < deadline:
            for chunk, stopping in list(self.stopping.items()):
                if stopping.engine.release(stopping.xfer):
                    self._stopped(chunk)
            time.sleep(0.001)
        h = self.held
        left = [Zombie(s.engine, s.xfer, h.model, h.version, p.Read(chunk=c, source=s.source), h.world,
                       tuple(h.shards)) for c, s in self.stopping.items()]
        self.stopping.clear()
        return left

    def unpinned(self) -> p.Progress:
        """After ``stop``: the reads that ended, as a report that unpins exactly them."""
        h = self.held
        failed = self.failed + [p.Read(chunk=c, source=v.source) for c, v in self.verifying.items()]
        done, tiled = list(self.done), list(self.tiled)
        asked = getattr(self, "asked", None)
        if asked is not None:  # its reply may never come: report what it carried again (idempotent)
            failed += asked.op.failed
            done += asked.op.chunks
            tiled += asked.op.tiled
        return p.Progress(name=self.ep.name, model=h.model, version=h.version, chunks=done, failed=failed,
                          incarnation=self.ep.incarnation, tiled=tiled, layout=h.placed.layout)
