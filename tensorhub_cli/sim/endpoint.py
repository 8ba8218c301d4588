"""Simulated endpoints: they speak the real protocol to the real hub, and move chunks
as flows of the network model.

Protocol: an endpoint ``register``s (``p.Register`` with its place), heartbeats every
``heartbeat_s`` while alive (the world sends one period's beats as a batch), and either ``publish``es a shard (``p.Publish``) or
``fetch``es a version. A ``Fetch`` is the reader loop of ``endpoint/fetch.py`` step
for step: ``Resolve``, then ``Plan`` with its window; every planned read it is not
running yet starts at once as one flow from the holder's GPU to its own; a landed
chunk is verified (``verifiers`` at a time, ``verify_s`` + bytes at ``verify_gbps``)
and only then counts; results go back with the next ``Plan`` once half the window has
finished, or ``report_s`` after the first of them, or when nothing is left in flight;
a plan with no reads while idle is asked again after a back-off doubling from 0.2 ms
to 50 ms; a read the hub no longer lists (its holder expired) is abandoned; a read
from a holder that died fails after ``read_error_s`` and is reported as failed (the
hub re-plans it elsewhere), with the loop's back-off when only failures are reported.
A hub ``Error`` ends the fetch (``on_error``), as ``FetchError`` does.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

# The reader's pacing is endpoint/fetch.py's own (a light import: no torch, no sockets).
from ..endpoint.fetch import IDLE_MAX_S as IDLE_MAX
from ..endpoint.fetch import IDLE_MIN_S as IDLE_MIN
from ..endpoint.fetch import REFILL_MAX_S, REFILL_MIN_S
from ..hub import protocol as p
from .reader import ScheduledFetch



class Wires(Protocol):
    """What an endpoint needs of its world (``sim.world.World`` is one): the clock and
    its events, the hub, the network, and the other endpoints. Named here so this
    module does not import the world that imports it."""

    loop: Any
    hub: Any
    endpoints: dict
    publishers: set
    fetch_params: Any
    chunk_sizes: dict
    running: bool

    def beating(self, ep: "SimEndpoint") -> None: ...
    def is_publisher(self, name: str) -> bool: ...
    def transfer(self, src: "SimEndpoint", fetch: Any, chunk: int, nbytes: int) -> int: ...
    def holds(self, ep: "SimEndpoint", version_key: tuple, chunk: int) -> None: ...
    def stop_transfer(self, fid: int) -> None: ...


class SimEndpoint:
    def __init__(self, world: Wires, name: str, gpu, role: str, reliable: bool = True):
        self.world, self.name, self.gpu = world, name, gpu
        self.info = p.EndpointInfo(name=name, node=gpu.node, rack=gpu.rack, dc=gpu.dc, role=role,
                                   reliable=reliable, tier="device", engine="sim", pid=gpu.index + 1,
                                   incarnation=name)
        self.alive = True
        self.registered_at: float | None = None
        self.fetches: list[Fetch] = []
        self.heard_at = float("-inf")  # the hub's last answer to a plan of ours (a beat in effect)
        self.published: set[tuple[str, int]] = set()  # (model, version): what a delta may be cut against

    def register(self, then: Callable[[], None] | None = None) -> None:
        def done(body):
            if isinstance(body, p.Error):
                raise RuntimeError(f"{self.name}: register refused: {body.code}: {body.message}")
            self.registered_at = self.world.loop.now
            self.world.beating(self)
            if then is not None:
                then()

        self.world.hub.call(p.Register(info=self.info), done)

    def heartbeat(self) -> p.Heartbeat:
        """A beat, telling how far each fetch running here is (as ``endpoint.service``'s)."""
        filling = [p.Filling(model=f.model, version=f.version, held=p.bitset(told))
                   for f in self.fetches if f.active and (told := f.told())]
        return p.Heartbeat(name=self.name, incarnation=self.name, filling=filling)

    def publish(self, model: str, version: int, manifest: p.Manifest, rank: int, world: int,
                then: Callable[[], None]) -> None:
        def done(body):
            if isinstance(body, p.Error):
                raise RuntimeError(f"{self.name}: publish refused: {body.code}: {body.message}")
            self.published.add((model, version))
            then()

        self.world.hub.call(p.Publish(name=self.name, model=model, version=version, manifest=manifest,
                                      rank=rank, world=world, incarnation=self.name), done)

    def fetch(self, model: str, version: int, *, want: int = 0, on_done: Callable[["Fetch"], None],
              on_error: Callable[["Fetch", p.Error], None] | None = None,
              resolve: Callable[[Callable], None] | None = None) -> "Fetch":
        """``resolve``: how the fetch learns the version (given its reply callback), where
        not by its own ``Resolve``: a group's shared one (``scenario.SharedResolve``)."""
        kind = ScheduledFetch if self.world.fetch_params.protocol == "schedule" else Fetch
        f = kind(self, model, version, want, on_done, on_error, resolve)
        self.fetches.append(f)
        f.start()
        return f

    def die(self) -> None:
        """Stop at once: no more beats or plans; each open fetch ends as ``killed``."""
        self.alive = False
        for f in self.fetches:
            if not f.finished:
                f.finished, f.ended = True, self.world.loop.now
                f.error = p.Error(code="killed", message=f"{self.name} died")
                if f.on_error is not None:
                    f.on_error(f, f.error)


class Fetch:
    def __init__(self, ep: SimEndpoint, model: str, version: int, want: int, on_done, on_error, resolve=None):
        self.ep, self.model, self.version = ep, model, version
        self.cfg = ep.world.fetch_params
        self.window = self.cfg.window
        self.want = want.to_bytes((want.bit_length() + 7) // 8, "little") if want else b""
        self.on_done, self.on_error = on_done, on_error
        self.resolve: Callable[[Callable], None] | None = resolve  # (SimEndpoint.fetch)
        self.inflight: dict[int, tuple[str, int]] = {}  # chunk -> (source, flow id)
        self.verifying: dict[int, str] = {}
        self.held: set[int] = set()
        self.done: list[int] = []
        self.failed: list[p.Read] = []
        self.sizes: list[int] = []
        self.asked = False
        self.plan_due = True
        self.first_result = 0.0
        self.idle = IDLE_MIN
        self.backoff = 0.0
        self.refill_s = REFILL_MIN_S
        self.sleeping = False
        self.finished = False
        self.started = ep.world.loop.now
        self.planned_at: float | None = None  # the hub's first answer to our plans
        self.ended: float | None = None
        self.error: p.Error | None = None
        self.plans = 0
        self.bytes = 0
        self.from_publishers = 0
        self._verifiers = [0.0] * self.cfg.verifiers

    @property
    def active(self) -> bool:
        return not self.finished and self.ep.alive and self.ep.world.running

    def told(self) -> int:
        """(A beat's ``Filling``.) Nothing: a window's plans report as they go. (A real
        windowed fetch's beats carry its progress too; their cost is not modelled here.)"""
        return 0

    def start(self) -> None:
        if self.resolve is not None:
            return self.resolve(self._resolved)
        self.ep.world.hub.call(p.Resolve(name=self.ep.name, model=self.model, version=self.version), self._resolved)

    def _resolved(self, body) -> None:
        if not self.active:
            return
        if isinstance(body, p.Error):
            return self._end(body)
        key = (self.model, body.version)
        sizes = self.ep.world.chunk_sizes.get(key)
        if sizes is None:  # (the same for every reader: worked out once per version)
            sizes = self.ep.world.chunk_sizes[key] = [c.nbytes for m in body.shards for c in m.chunks]
        self.sizes = sizes
        self.step()

    # --- the loop body, run on every event that concerns this fetch --------------------
    def step(self) -> None:
        if not self.active or self.sleeping:
            return
        now = self.ep.world.loop.now
        busy = len(self.inflight) + len(self.verifying)
        results = len(self.done) + len(self.failed)
        if results and (2 * results >= self.window or now - self.first_result >= self.cfg.report_s or not busy):
            self.plan_due = True
        if not busy and not results and not self.asked:
            self.plan_due = True
        if not self.asked and self.plan_due and (results or len(self.inflight) < self.window):
            self._ask()

    def _ask(self) -> None:
        world = self.ep.world
        only_failures = self.failed and not self.done
        op = p.Plan(name=self.ep.name, model=self.model, version=self.version, window=self.window,
                    chunks=self.done, failed=self.failed, incarnation=self.ep.name, want=self.want)
        self.done, self.failed = [], []
        self.asked, self.plan_due = True, False
        self.plans += 1
        self.backoff = min(max(0.01, self.backoff * 2), 0.5) if only_failures else 0.0
        if self.backoff:
            world.loop.after(self.backoff, world.hub.call, op, self._answer)
        else:
            world.hub.call(op, self._answer)

    def _answer(self, body) -> None:
        if not self.active:
            return
        self.asked = False
        if isinstance(body, p.Error):
            return self._end(body)
        self.ep.heard_at = self.ep.world.loop.now
        if self.planned_at is None:
            self.planned_at = self.ep.heard_at
        if body.complete:
            return self._end(None)
        busy = len(self.inflight) + len(self.verifying)
        started = len(self.inflight)
        self._start_planned(body)
        # As Fetch._refill_later: free slots are asked for again soon, backing off
        # while plans grant nothing new.
        self.refill_s = REFILL_MIN_S if len(self.inflight) > started else min(REFILL_MAX_S, self.refill_s * 2)
        if len(self.inflight) < self.window:
            self.ep.world.loop.after(self.refill_s, self._refill)
        if not body.reads and not busy:
            # Nothing to read yet (sources busy, a seed filling beyond a DC link).
            self.idle = min(self.idle * 2, IDLE_MAX)
            self.sleeping = True
            self.ep.world.loop.after(self.idle, self._wake)
            return
        self.step()

    def _refill(self) -> None:
        if self.active and not self.sleeping and not self.asked and len(self.inflight) < self.window:
            self.plan_due = True
            self.step()

    def _wake(self) -> None:
        self.sleeping = False
        self.plan_due = True
        self.step()

    def _start_planned(self, planned: p.Planned) -> None:
        world = self.ep.world
        listed = {r.chunk: r.source for r in planned.reads}
        for chunk, (source, fid) in list(self.inflight.items()):
            if listed.get(chunk) != source:  # re-planned by the hub: its source is gone
                del self.inflight[chunk]
                world.stop_transfer(fid)
        unreported = {r.chunk for r in self.failed}
        for read in planned.reads:
            c = read.chunk
            if c in self.inflight or c in self.verifying or c in self.held or c in unreported:
                continue
            src = world.endpoints.get(read.source)
            nbytes = self.sizes[c]
            if src is None or not src.alive:  # the engine cannot reach it: the read fails
                self.inflight[c] = (read.source, 0)
                world.loop.after(self.cfg.read_error_s, self.read_failed, c, read.source, 0)
                continue
            fid = world.transfer(src, self, c, nbytes)
            self.inflight[c] = (read.source, fid)

    # --- what the network and the verifiers report ---------------------------------------
    def landed(self, chunk: int, fid: int, rebuild_s: float = 0.0) -> None:
        """The flow ended; a delta (``rebuild_s`` > 0) is rebuilt on the verifier first."""
        got = self.inflight.get(chunk)
        if got is None or got[1] != fid or not self.active:
            return
        del self.inflight[chunk]
        source = got[0]
        self.verifying[chunk] = source
        nbytes = self.sizes[chunk]
        now = self.ep.world.loop.now
        i = min(range(len(self._verifiers)), key=self._verifiers.__getitem__)
        t = (max(now, self._verifiers[i]) + rebuild_s + self.cfg.verify_s
             + nbytes * 8 / (self.cfg.verify_gbps * 1e9))
        self._verifiers[i] = t
        self.ep.world.loop.at(t, self._verified, chunk, source)

    def _verified(self, chunk: int, source: str) -> None:
        if not self.active or self.verifying.pop(chunk, None) is None:
            return
        self.held.add(chunk)
        self.ep.world.holds(self.ep, (self.model, self.version), chunk)  # a base for v+1's deltas
        self.bytes += self.sizes[chunk]
        if self.ep.world.is_publisher(source):
            self.from_publishers += self.sizes[chunk]
        self._result()
        self.done.append(chunk)
        self.idle = IDLE_MIN
        self.step()

    def read_failed(self, chunk: int, source: str, fid: int) -> None:
        got = self.inflight.get(chunk)
        if not self.active or got is None or got != (source, fid):
            return
        del self.inflight[chunk]
        self._result()
        self.failed.append(p.Read(chunk=chunk, source=source))
        self.idle = IDLE_MIN
        self.step()

    def _result(self) -> None:
        if not self.done and not self.failed:
            self.first_result = self.ep.world.loop.now
            # wake when the report is due even if nothing else happens by then
            self.ep.world.loop.after(self.cfg.report_s, self.step)

    def _end(self, error: p.Error | None) -> None:
        self.finished = True
        self.ended = self.ep.world.loop.now
        self.error = error
        for _, fid in self.inflight.values():
            if fid:
                self.ep.world.stop_transfer(fid)
        self.inflight.clear()
        if error is not None and self.on_error is not None:
            self.on_error(self, error)
        elif error is None:
            self.on_done(self)
        else:
            raise RuntimeError(f"{self.ep.name}: fetch of {self.model}@{self.version} failed: "
                               f"{error.code}: {error.message}")

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else self.ep.world.loop.now) - self.started
