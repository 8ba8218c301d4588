"""A simulated scheduled reader: ``endpoint.reader.Reader`` (the reader's algorithm,
sans I/O) driven by the simulator's events instead of sockets and engines.

Protocol: ``Resolve`` (or its instance's shared one, ``scenario.SharedResolve``), then
the core's actions carried out in simulated time: ``Ask`` is a ``Plan`` with
``schedule`` to the real hub (its answer comes back as ``Answer``);
``Start`` is one flow of the chunk's bytes (or its fragment's) from the source's GPU to
ours (``Landed`` when it ends; a dead source's read fails after ``read_error_s``);
``Relay`` tells the world what landed (``World.relayed``); ``Verify`` queues the
checksum on one of ``verifiers`` (``verify_s`` + bytes at ``verify_gbps``, after the
delta's rebuild time when the world sent the chunk as a delta) and answers
``Checked``; ``Await`` asks the source for a notice: answered after half a round trip
once the source holds one of the chunks (a publisher holds its shard), or, asked with
``after``, has landed more of one, or
``AwaitFailed`` after ``read_error_s`` when the source is dead. Nothing polls: the core
is stepped on each event, and on its ``wake_at`` (timeouts, the paced re-ask).
"""

from __future__ import annotations

from ..endpoint import reader as core
from ..hub import protocol as p


class ScheduledFetch:
    def __init__(self, ep, model: str, version: int, want: int, on_done, on_error, resolve=None):
        self.ep, self.model, self.version, self.want = ep, model, version, want
        self.world = ep.world
        self.cfg = self.world.fetch_params
        self.on_done, self.on_error = on_done, on_error
        self.resolve = resolve  # (SimEndpoint.fetch)
        self.finished = False
        self.started = self.world.loop.now
        self.planned_at: float | None = None  # the hub's first answer to our plans
        self.ended: float | None = None
        self.error: p.Error | None = None
        self.plans = 0
        self.bytes = 0
        self.from_publishers = 0
        self.sizes: list[int] = []
        self.core: core.Reader | None = None
        self.flows: dict[int, int] = {}  # chunk -> flow id
        self._rebuild: dict[int, float] = {}  # chunk -> seconds to rebuild it from a delta
        self._verifiers = [0.0] * self.cfg.verifiers
        self._wake_at = float("inf")

    @property
    def active(self) -> bool:
        return not self.finished and self.ep.alive and self.world.running

    @property
    def held(self) -> set[int]:
        """Chunks verified so far."""
        return set(self.core.by[core.HELD]) if self.core else set()

    def told(self) -> int:
        """The chunks verified so far, as a mask (a beat's ``Filling``)."""
        return p.mask_of(self.core.by[core.HELD]) if self.core else 0

    @property
    def key(self) -> tuple[str, int]:
        return self.model, self.version

    def start(self) -> None:
        if self.resolve is not None:
            return self.resolve(self._resolved)
        self.world.hub.call(p.Resolve(name=self.ep.name, model=self.model, version=self.version), self._resolved)

    def _resolved(self, body) -> None:
        if not self.active:
            return
        if isinstance(body, p.Error):
            return self._end(body)
        sizes = self.world.chunk_sizes.get((self.model, body.version))
        if sizes is None:
            sizes = self.world.chunk_sizes[(self.model, body.version)] = [c.nbytes for m in body.shards for c in m.chunks]
        self.sizes = sizes
        wanted = self.want or (1 << len(sizes)) - 1
        self.core = core.Reader(wanted, window=self.cfg.window, read_timeout=float("inf"), wait_timeout=float("inf"),
                                fragments=self.cfg.fragments, size=sizes.__getitem__)
        self.step([])

    # --- the core's loop ------------------------------------------------------------------
    def step(self, events: list) -> None:
        if not self.active:
            return
        now = self.world.loop.now
        for action in self.core.step(now, events):
            self._do(action, now)
        if self.finished:
            return
        at = self.core.wake_at
        if at < self._wake_at and at != float("inf"):
            self._wake_at = at
            self.world.loop.at(max(at, now), self._woken, at)

    def _woken(self, at: float) -> None:
        if at == self._wake_at:
            self._wake_at = float("inf")
            self.step([])

    def _do(self, a, now: float) -> None:
        w = self.world
        if isinstance(a, core.Ask):
            self.plans += 1
            want = self.want.to_bytes((self.want.bit_length() + 7) // 8, "little") if self.want else b""
            op = p.Plan(name=self.ep.name, model=self.model, version=self.version, window=self.cfg.window,
                        held=p.bitset(p.mask_of(a.done)) if a.done else b"",
                        failed=[p.Read(chunk=c, source=s) for c, s in a.failed],
                        incarnation=self.ep.name, want=want, schedule=True)
            w.hub.call(op, self._answered)
        elif isinstance(a, core.Start):
            src = w.endpoints.get(a.source)
            if src is None or not src.alive:  # the engine cannot reach it: the read fails
                w.loop.after(self.cfg.read_error_s, self._failed_read, a.chunk, 0)
                return
            self.flows[a.chunk] = w.transfer(src, self, a.chunk, a.nbytes or self.sizes[a.chunk], bool(a.nbytes))
        elif isinstance(a, core.Relay):
            w.relayed(self.ep, self.key, a.chunk, a.nbytes)
        elif isinstance(a, core.Verify):
            nbytes = self.sizes[a.chunk]
            i = min(range(len(self._verifiers)), key=self._verifiers.__getitem__)
            t = (max(now, self._verifiers[i]) + self._rebuild.pop(a.chunk, 0.0) + self.cfg.verify_s
                 + nbytes * 8 / (self.cfg.verify_gbps * 1e9))
            self._verifiers[i] = t
            w.loop.at(t, self._verified, a.chunk, a.source)
        elif isinstance(a, core.Await):
            w.await_chunks(self, a.source, a.chunks, a.after)
        elif isinstance(a, core.Stop):
            fid = self.flows.pop(a.chunk, 0)
            if fid:
                w.stop_transfer(fid)
            w.loop.after(0.0, self.step, [core.Stopped(a.chunk)])
        elif isinstance(a, core.Done):
            self._end(None)
        elif isinstance(a, core.Failed):
            self._end(p.Error(code="failed", message=a.message))

    def _answered(self, body) -> None:
        if not self.active:
            return
        if isinstance(body, p.Error):
            return self._end(body)
        self.ep.heard_at = self.world.loop.now
        if self.planned_at is None:
            self.planned_at = self.ep.heard_at
        reads = body.listed()
        # (a delta is read whole, as the real reader reads a read the hub gave a base)
        self.core.whole.update(r.chunk for r in reads if self.world.sends_delta(r.source, self, r.chunk))
        self.step([core.Answer([(r.chunk, r.source, r.ready, r.tiled) for r in reads], body.complete,
                               body.first, body.serial and self.cfg.serial_heads)])

    # --- what the network, the verifiers and the sources report -----------------------------
    def landed(self, chunk: int, fid: int, rebuild_s: float = 0.0) -> None:
        if self.flows.get(chunk) != fid:
            return
        del self.flows[chunk]
        if rebuild_s:
            self._rebuild[chunk] = rebuild_s
        self.step([core.Landed(chunk, True)])

    def read_failed(self, chunk: int, source: str, fid: int) -> None:
        """A flow from ``source`` broke (the source died)."""
        if self.flows.get(chunk) == fid:
            del self.flows[chunk]
            self.step([core.Landed(chunk, False)])

    def _failed_read(self, chunk: int, fid: int) -> None:
        self.step([core.Landed(chunk, False)])

    def _verified(self, chunk: int, source: str) -> None:
        if not self.active:
            return
        self.bytes += self.sizes[chunk]
        if self.world.is_publisher(source):
            self.from_publishers += self.sizes[chunk]
        self.step([core.Checked(chunk, True)])
        self.world.holds(self.ep, self.key, chunk)

    def noticed(self, source: str, chunks: int, landed: dict | None = None) -> None:
        self.step([core.Noticed(source, chunks, landed or {})])

    def await_failed(self, source: str) -> None:
        self.step([core.AwaitFailed(source)])

    def _end(self, error: p.Error | None) -> None:
        self.finished = True
        self.ended = self.world.loop.now
        self.error = error
        for fid in self.flows.values():
            self.world.stop_transfer(fid)
        self.flows.clear()
        if error is None:
            self.on_done(self)
        elif self.on_error is not None:
            self.on_error(self, error)
        else:
            raise RuntimeError(f"{self.ep.name}: fetch of {self.model}@{self.version} failed: "
                               f"{error.code}: {error.message}")

    @property
    def seconds(self) -> float:
        return (self.ended if self.ended is not None else self.world.loop.now) - self.started
