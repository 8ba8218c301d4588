"""`th bench hub --replay`: the `th bench hub` mix against the hub in this process, on a
fixed schedule.

Why: the socket bench's waves differ from run to run (whose request lands first decides
who waits), so its hub CPU per version spreads as widely as a planner change moves it.
The replay runs the same hub code a request meets (``HubService.handle``: decode, auth,
the state machine, encode; all but zmq) with the same endpoints, manifests and op mix,
on a simulated clock: the same ops in the same order every run. Two runs differ only in
CPU speed, and ``plans_digest`` says whether a change altered a single plan.

Schedule. One FIFO of requests, answered one at a time (the hub is serial), each
answer ``op_s`` of simulated time. Every endpoint registers; the trainer (endpoint 0)
publishes v1; every other endpoint resolves it, then plans and reports its reads
(``Progress``) in turn until it holds the whole version. Reads take no time (the load
generator reports them at once too). A plan that gives nothing is asked again
``wait_s`` later; every endpoint heartbeats every ``heartbeat_s``; the hub's sweep runs
as ``HubService`` would schedule it. Then v2, the same, while v1 stays held.

With ``protocol="schedule"`` (the default) readers ask for a schedule (``Plan.schedule``):
one plan gives every chunk a source, some of which do not hold it yet; a read lands as
soon as its source truly holds the chunk (the replay keeps the truth, as the source's
notice would tell the reader), and a reader reports in batches (a quarter of its
chunks, as ``endpoint/scheduled.py``), so the hub sees a handful of ops per reader.
``protocol="window"`` is the windowed loop above.

Figures per version (``v1``, ``v2``): ``hub_cpu_s`` (process CPU time spent in
``handle`` and the sweep: what the version cost the hub), ``cpu_us`` per op kind
(``wait_cpu_us``: of plans, those that gave nothing), and ``ops_per_cpu_s`` (ops over
that CPU: what one core sustains with no socket I/O, a ceiling for the socket bench's
ops/s).
"""

from __future__ import annotations

import hashlib
import heapq
import random
import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from ..endpoint.reader import batch
from ..hub import protocol as p
from ..hub.machine import Hub, HubConfig
from ..hub.service import HubService
from .hubload import MODEL, manifest, topology

EXPIRY_S = 10.0  # as `th bench hub` starts its hub


class ReplayError(Exception):
    pass


class Clock:
    """The simulated time the hub reads (``HubService``'s clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Phase:
    ops: dict[str, int] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    waits: int = 0
    wait_cpu_s: float = 0.0  # of the plans' CPU, what the plans that gave nothing cost
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)

    def charge(self, kind: str, cpu_s: float) -> None:
        self.cpu_s[kind] = self.cpu_s.get(kind, 0.0) + cpu_s
        self.ops[kind] = self.ops.get(kind, 0) + 1

    def summary(self, chunks: int, sim_s: float) -> dict:
        cpu = sum(self.cpu_s.values())
        return {"chunks": chunks, "sim_s": round(sim_s, 3), "ops": dict(sorted(self.ops.items())),
                "plans": self.ops.get("plan", 0), "waits": self.waits, "hub_cpu_s": round(cpu, 3),
                "cpu_us": {k: round(1e6 * self.cpu_s[k] / n, 1) for k, n in sorted(self.ops.items()) if n},
                "wait_cpu_us": round(1e6 * self.wait_cpu_s / self.waits, 1) if self.waits else None,
                "ops_per_cpu_s": round(sum(self.ops.values()) / cpu, 1) if cpu else None,
                "plans_digest": self.digest.hexdigest()[:16]}


class Replay:
    def __init__(self, planner: str, op_s: float):
        self.clock = Clock()
        self.token = secrets.token_hex(16)
        self.hub = Hub(HubConfig(expiry_s=EXPIRY_S, planner=planner), now=0.0)
        # An inproc endpoint: the service needs a socket to exist, and this one no peer reaches.
        self.service = HubService(self.hub, self.token, f"inproc://th-replay-{secrets.token_hex(4)}",
                                  clock=self.clock)
        self.op_s = op_s
        self.next_sweep = self.service.sweep_s
        self.rid = 0

    def call(self, phase: Phase, kind: str, op: p.Op) -> tuple[p.Body, float]:
        """One request through the service, its CPU charged to ``kind``: the reply's body
        and that CPU time. Refused → ReplayError."""
        self.rid += 1
        frame = p.encode(p.Request(v=p.PROTOCOL_VERSION, token=self.token, rid=self.rid, op=op))
        t = time.process_time()
        out = self.service.handle(b"replay", [frame])
        cpu = time.process_time() - t
        phase.charge(kind, cpu)
        self.clock.now += self.op_s
        body = p.decode_reply(out[0][1]).body
        if isinstance(body, p.Error):
            raise ReplayError(f"the hub refused {type(op).__name__} from {getattr(op, 'name', '?')}: "
                              f"{body.code}: {body.message}")
        return body, cpu

    def sweep_due(self, phase: Phase) -> None:
        while self.clock.now >= self.next_sweep:
            t = time.process_time()
            self.service.sweep()
            phase.charge("sweep", time.process_time() - t)
            self.next_sweep += self.service.sweep_s

    def close(self) -> None:
        self.service.close()


def _wave(rp: Replay, phase: Phase, names: list[str], number: int, window: int, wait_s: float,
          heartbeat_s: float, deadline: float) -> None:
    """Every reader resolves, then plans and reports until it holds version ``number``."""
    queue: deque[tuple[str, str]] = deque(("resolve", n) for n in names[1:])
    parked: list[tuple[float, int, str]] = []  # (due, order, reader): told to wait
    reports: dict[str, list[int]] = {}
    next_beat, done, order = rp.clock.now, 0, 0
    while done < len(names) - 1:
        if time.monotonic() > deadline:
            raise ReplayError(f"v{number} not replayed in time: {done}/{len(names) - 1} readers complete")
        now = rp.clock.now
        while parked and parked[0][0] <= now:
            queue.append(("plan", heapq.heappop(parked)[2]))
        if now >= next_beat:
            queue.extend(("heartbeat", n) for n in names)
            next_beat = now + heartbeat_s
        rp.sweep_due(phase)
        if not queue:  # every reader waits: time passes
            rp.clock.now = max(now, parked[0][0])
            continue
        kind, name = queue.popleft()
        if kind == "heartbeat":
            rp.call(phase, kind, p.Heartbeat(name=name))
        elif kind == "resolve":
            rp.call(phase, kind, p.Resolve(name=name, model=MODEL))
            queue.append(("plan", name))
        elif kind == "progress":
            rp.call(phase, kind, p.Progress(name=name, model=MODEL, version=number, chunks=reports.pop(name)))
            queue.append(("plan", name))
        else:
            body, cpu = rp.call(phase, kind, p.Plan(name=name, model=MODEL, version=number, window=window))
            reads = [(r.chunk, r.source) for r in body.reads]
            phase.digest.update(repr((name, reads, body.waiting, body.complete)).encode())
            if body.complete:
                done += 1
            elif reads:
                reports[name] = [c for c, _ in reads]
                queue.append(("progress", name))
            else:
                phase.waits += 1
                phase.wait_cpu_s += cpu
                order += 1
                heapq.heappush(parked, (rp.clock.now + wait_s, order, name))


def _scheduled_wave(rp: Replay, phase: Phase, names: list[str], number: int, heartbeat_s: float,
                    deadline: float) -> None:
    """Every reader resolves, asks for its schedule, and reports in batches until it
    holds version ``number``; a read lands once its source truly holds the chunk."""
    trainer = names[0]
    have: dict[str, int] = {}  # the truth: what each reader holds
    pending: dict[str, dict[int, str]] = {}  # reader -> its scheduled reads not landed
    landed: dict[str, list[int]] = {}  # landed, not reported
    every: dict[str, int] = {}
    waiters: dict[str, set[str]] = {}  # source -> readers waiting on it
    queue: deque[tuple[str, str]] = deque(("resolve", n) for n in names[1:])
    next_beat, done = rp.clock.now, 0

    def holds(source: str, chunk: int) -> bool:
        return source == trainer or bool(have.get(source, 0) >> chunk & 1)

    def advance(name: str) -> None:
        """Land what can land (transitively: readers waiting on those who gained)."""
        work = [name]
        while work:
            n = work.pop()
            reads = pending.get(n, {})
            got = [c for c, s in reads.items() if holds(s, c)]
            for c in got:
                del reads[c]
                have[n] = have.get(n, 0) | 1 << c
            if got:
                landed.setdefault(n, []).extend(got)
                work.extend(waiters.pop(n, ()))
            if len(landed.get(n, ())) >= every[n] or (not reads and landed.get(n)):
                if ("plan", n) not in queue:
                    queue.append(("plan", n))
            else:
                for s in set(reads.values()):
                    waiters.setdefault(s, set()).add(n)

    while done < len(names) - 1:
        if time.monotonic() > deadline:
            raise ReplayError(f"v{number} not replayed in time: {done}/{len(names) - 1} readers complete")
        if rp.clock.now >= next_beat:
            queue.extend(("heartbeat", n) for n in names)
            next_beat = rp.clock.now + heartbeat_s
        rp.sweep_due(phase)
        if not queue:
            raise ReplayError(f"v{number}: every reader waits on a source that will never hold its chunk "
                              f"({done}/{len(names) - 1} complete)")
        kind, name = queue.popleft()
        if kind == "heartbeat":
            rp.call(phase, kind, p.Heartbeat(name=name))
        elif kind == "resolve":
            body, _ = rp.call(phase, kind, p.Resolve(name=name, model=MODEL))
            every[name] = batch(sum(len(m.chunks) for m in body.shards))
            queue.append(("plan", name))
        else:
            report = landed.pop(name, [])
            body, cpu = rp.call(phase, kind, p.Plan(name=name, model=MODEL, version=number, schedule=True,
                                                    held=p.bitset(p.mask_of(report)) if report else b""))
            reads = [(r.chunk, r.source, r.ready) for r in body.listed()]
            phase.digest.update(repr((name, reads, body.waiting, body.complete)).encode())
            if body.complete:
                done += 1
                continue
            if not reads:
                phase.waits += 1
                phase.wait_cpu_s += cpu
            pending[name] = {c: s for c, s, _ in reads if not have.get(name, 0) >> c & 1}
            advance(name)


def run(endpoints: int = 1000, tensors: int = 1000, chunk_mb: int = 64, window: int = 32, planner: str = "ros",
        seed: int = 0, op_s: float = 1e-4, wait_s: float = 0.002, heartbeat_s: float = 1.0,
        timeout_s: float = 600.0, protocol: str = "schedule") -> dict:
    """The replay's figures (module docstring); ReplayError if the hub refuses an op or a
    version is not replayed within ``timeout_s`` (wall clock)."""
    rng = random.Random(seed)
    infos = topology(endpoints)
    names = [i.name for i in infos]
    rp = Replay(planner, op_s)
    if protocol not in ("schedule", "window"):
        raise ReplayError(f"protocol must be schedule or window, not {protocol!r}")
    result: dict = {"mode": "replay", "endpoints": endpoints, "tensors": tensors, "window": window,
                    "planner": planner, "protocol": protocol}
    try:
        setup = Phase()
        for info in infos:
            rp.call(setup, "register", p.Register(info=info))
        deadline = time.monotonic() + timeout_s
        for number in (1, 2):
            m = manifest(tensors, chunk_mb, rng)
            rp.call(setup, "publish", p.Publish(name=names[0], model=MODEL, version=number, manifest=m))
            phase, start = Phase(), rp.clock.now
            if protocol == "schedule":
                _scheduled_wave(rp, phase, names, number, heartbeat_s, deadline)
            else:
                _wave(rp, phase, names, number, window, wait_s, heartbeat_s, deadline)
            result[f"v{number}"] = phase.summary(len(m.chunks), rp.clock.now - start)
        result["versions"] = [(v.version, v.state, v.complete_replicas) for v in rp.hub.status(rp.clock.now).versions]
    finally:
        rp.close()
    digest = hashlib.sha256(f"{result['v1']['plans_digest']}{result['v2']['plans_digest']}".encode())
    result.update(hub_cpu_s=result["v1"]["hub_cpu_s"], ops_per_cpu_s=result["v1"]["ops_per_cpu_s"],
                  plans_digest=digest.hexdigest()[:16])
    return result
