"""Load generator for `th bench hub`: N simulated endpoints driving one real hub.

Protocol. Over one DEALER socket the generator plays N endpoints spread over a
two-DC topology (8 endpoints per node, like 8-GPU nodes); endpoint 0 is the trainer.
Phases, each a real exchange with the hub, nothing skipped or faked:

1. ``register``: every endpoint registers (timed: registrations per second).
2. ``throughput``: the trainer publishes v1, a manifest of ``tensors`` tensors cut
   into ``chunk_mb`` chunks. Every other endpoint resolves ``latest`` and runs the
   fetch loop (plan for ``window`` reads → progress → plan …) until it holds every
   chunk, so each becomes a holder other readers are planned onto. Up to ``depth``
   requests are in flight, and every endpoint heartbeats every ``heartbeat_s``.
   ``ops_per_s`` = replies / s.
3. ``latency``: the trainer publishes v2 and the same wave runs with one request in
   flight, so a plan's round trip is its service time plus one loopback hop, not
   queueing behind other requests. Every endpoint now holds the whole of v1.

``--protocol schedule`` (the default, as real readers do): each reader asks for its
schedule (``Plan.schedule``) and reports inside its next plan, as ``endpoint.reader``
does: a batch of ``endpoint.reader.batch`` chunks (never more: reads here end at once, a real
reader's over time), the last ones, or what it has after 2 ms idle. A
read is done once its source holds the chunk: the trainer from the start, a reader once
it reported it. A read scheduled onto a parent that does not hold the chunk yet waits
for that parent's report, here in the generator, as a reader waits on its parent's
notice: no hub round trip. A reader with nothing outstanding asks again after 2 ms.
``window``: the windowed loop (plan for ``window`` reads, report them all, plan again).

Prints one JSON object on stdout. The hub's CPU time over each phase (user + system,
from psutil: ``hub_cpu_s``, one version's whole wave, and ``hub_cpu_util``) tells
whether the hub or this generator was the limit, and what a version cost the hub.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from ..endpoint.reader import batch
from ..hub import protocol as p
from ..launch.procs import cpu_seconds

MODEL = "bench"
PER_NODE = 8
RACKS_PER_DC = 4


def topology(n: int) -> list[p.EndpointInfo]:
    nodes = -(-n // PER_NODE)
    out = []
    for i in range(n):
        node = i // PER_NODE
        dc = 0 if node < -(-nodes // 2) else 1
        rack = node % RACKS_PER_DC
        out.append(p.EndpointInfo(name=f"ep{i:05d}", node=f"n{node:04d}", rack=f"dc{dc}-r{rack}", dc=f"dc{dc}",
                                  role="trainer" if i == 0 else "rollout", pid=os.getpid(),
                                  engine="nixl", engine_meta=b"\0" * 256))
    return out


def manifest(tensors: int, chunk_mb: int, rng: random.Random) -> p.Manifest:
    """LLM-shaped: mostly 1–32 MiB matrices; chunks are slices of the flat layout."""
    metas, offset = [], 0
    for i in range(tensors):
        nbytes = rng.randint(1, 32) << 20
        metas.append(p.TensorMeta(name=f"layers.{i // 10}.w{i % 10}", dtype="bfloat16", shape=[nbytes // 2],
                                  nbytes=nbytes, offset=offset))
        offset += nbytes
    chunk = chunk_mb << 20
    chunks = [p.ChunkMeta(nbytes=min(chunk, offset - start), checksum=rng.getrandbits(64))
              for start in range(0, offset, chunk)]
    return p.Manifest(tensors=metas, chunks=chunks, chunk_bytes=chunk)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Hub:
    """Pipelined request/reply over one DEALER socket."""

    def __init__(self, address: str, token: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.token = token
        self.rid = 0

    def send(self, op: p.Op) -> int:
        self.rid += 1
        self.sock.send(p.encode(p.Request(v=p.PROTOCOL_VERSION, token=self.token, rid=self.rid, op=op)))
        return self.rid

    def recv(self, timeout_s: float) -> p.Reply | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return p.decode_reply(self.sock.recv())

    def call(self, op: p.Op, timeout_s: float = 30.0) -> p.Body:
        rid = self.send(op)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.recv(deadline - time.monotonic())
            if reply is not None and reply.rid == rid:
                if isinstance(reply.body, p.Error):
                    raise RuntimeError(f"hub refused {type(op).__name__}: {reply.body.code}: {reply.body.message}")
                return reply.body
        raise TimeoutError(f"no reply to {type(op).__name__} within {timeout_s}s")


@dataclass
class Reader:
    name: str
    version: int = 0
    report: list[int] = field(default_factory=list)
    step: str = "resolve"  # resolve → plan ⇄ progress → done
    not_before: float = 0.0  # a reader told to wait (its DC's seed is filling) polls again later
    # schedule: reads outstanding (chunk -> source), those whose source holds the chunk,
    # what this reader holds, which answer it is on, and whether only a parent can wake it
    outstanding: dict[int, str] = field(default_factory=dict)
    doable: list[int] = field(default_factory=list)
    held: set[int] = field(default_factory=set)
    gen: int = 0
    blocked: bool = False
    batch: int = 8


@dataclass
class Wave:
    replies: int = 0
    plans: int = 0
    waits: int = 0
    heartbeats: int = 0
    op_ms: dict[str, list[float]] = field(default_factory=dict)  # round trip by operation
    errors: dict[str, int] = field(default_factory=dict)


class Schedules:
    """The schedule protocol's readers between hub answers: which read waits on which
    parent's report, and who may report (``Reader.report``) or ask again now."""

    IDLE_S = 0.002

    def __init__(self, readers: dict[str, Reader], trainer: str, ready: deque, parked: deque):
        self.readers, self.trainer, self.ready, self.parked = readers, trainer, ready, parked
        self.waits: dict[tuple[str, int], list[tuple[Reader, int]]] = {}

    def answered(self, r: Reader, reads: list[p.Read], now: float) -> None:
        r.gen += 1
        r.outstanding, r.doable = {}, []
        for x in reads:
            r.outstanding[x.chunk] = x.source
            if x.source == self.trainer or x.chunk in self.readers[x.source].held:
                r.doable.append(x.chunk)
            else:
                self.waits.setdefault((x.source, x.chunk), []).append((r, r.gen))
        self._next(r, now)

    def woken(self, now: float) -> None:
        while self.parked and self.parked[0].not_before <= now:
            r = self.parked.popleft()
            if r.doable or not r.outstanding:
                self._report(r, now)
            else:
                r.blocked = True

    def _next(self, r: Reader, now: float) -> None:
        if r.doable and (len(r.doable) >= r.batch or len(r.doable) == len(r.outstanding)):
            self._report(r, now)
        elif r.doable or not r.outstanding:
            r.not_before = now + self.IDLE_S
            self.parked.append(r)
        else:
            r.blocked = True

    def _report(self, r: Reader, now: float) -> None:
        # At most a batch: a real reader's reads end over time, so it reports batch by batch.
        r.report, r.doable = r.doable[:r.batch], r.doable[r.batch:]
        for c in r.report:
            del r.outstanding[c]
        r.held.update(r.report)
        self.ready.append(r)
        for c in r.report:
            for w, gen in self.waits.pop((r.name, c), ()):
                if gen == w.gen and c in w.outstanding:
                    w.doable.append(c)
                    if w.blocked:
                        w.blocked = False
                        self._next(w, now)


def run_wave(hub: Hub, names: list[str], depth: int, heartbeat_s: float, timeout_s: float,
             window: int = 32, schedule: bool = False, nchunks: int = 0) -> tuple[Wave, float]:
    wave = Wave()
    readers = {n: Reader(n, batch=batch(nchunks)) for n in names[1:]}
    ready = deque(readers.values())
    parked: deque[Reader] = deque()
    sched = Schedules(readers, names[0], ready, parked)
    inflight: dict[int, tuple[Reader | None, str, float]] = {}
    beats: deque[str] = deque()
    next_beat_round = time.monotonic()
    done = 0
    start = time.monotonic()
    while done < len(readers):
        now = time.monotonic()
        if now - start > timeout_s:
            raise TimeoutError(f"wave not done after {timeout_s}s: {done}/{len(readers)} readers complete")
        if schedule:
            sched.woken(now)
        while parked and parked[0].not_before <= now:
            ready.append(parked.popleft())
        while len(inflight) < depth:
            if now >= next_beat_round and not beats:  # every endpoint beats once per heartbeat_s
                beats.extend(names)
                next_beat_round = now + heartbeat_s
            if beats:
                inflight[hub.send(p.Heartbeat(name=beats.popleft()))] = (None, "heartbeat", time.perf_counter())
                continue
            if not ready:
                break
            r = ready.popleft()
            if r.step == "resolve":
                op: p.Op = p.Resolve(name=r.name, model=MODEL)
            elif r.step == "plan" and schedule:
                op = p.Plan(name=r.name, model=MODEL, version=r.version, schedule=True,
                            held=p.bitset(p.mask_of(r.report)) if r.report else b"")
                r.report = []
            elif r.step == "plan":
                op = p.Plan(name=r.name, model=MODEL, version=r.version, window=window)
            else:
                op = p.Progress(name=r.name, model=MODEL, version=r.version, chunks=r.report)
            inflight[hub.send(op)] = (r, r.step, time.perf_counter())
        reply = hub.recv(0.005 if parked or not inflight else 1.0)
        while reply is not None:
            r, step, sent = inflight.pop(reply.rid)
            wave.replies += 1
            wave.op_ms.setdefault(step, []).append((time.perf_counter() - sent) * 1e3)
            body = reply.body
            if isinstance(body, p.Error):
                wave.errors[body.code] = wave.errors.get(body.code, 0) + 1
                if r is not None:  # this reader's fetch is over; the wave still finishes
                    r.step = "done"
                    done += 1
            elif step == "heartbeat":
                wave.heartbeats += 1
            elif step == "resolve":
                r.version, r.step = body.version, "plan"
                ready.append(r)
            elif step == "plan" and schedule:
                wave.plans += 1
                if body.complete:
                    r.step = "done"
                    done += 1
                else:
                    reads = body.listed()
                    wave.waits += not reads
                    sched.answered(r, reads, time.monotonic())
            elif step == "plan":
                wave.plans += 1
                if body.complete:
                    r.step = "done"
                    done += 1
                elif body.reads:
                    r.report, r.step = [x.chunk for x in body.reads], "progress"
                    ready.append(r)
                else:
                    wave.waits += 1
                    r.not_before = time.monotonic() + 0.002
                    parked.append(r)
            else:
                r.step = "plan"
                ready.append(r)
            reply = hub.recv(0) if inflight else None
    elapsed = time.monotonic() - start
    while inflight:  # heartbeats still out: drain so the next phase starts clean
        reply = hub.recv(5.0)
        if reply is None:
            break
        inflight.pop(reply.rid, None)
    return wave, elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorhub_cli.bench.hubload")
    ap.add_argument("--address", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--hub-pid", type=int, required=True)
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--window", type=int, default=32, help="reads a reader asks for per plan (window)")
    ap.add_argument("--protocol", choices=("schedule", "window"), default="schedule")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    with open(args.token_file) as f:
        hub = Hub(args.address, f.read().strip())
    infos = topology(args.endpoints)
    names = [i.name for i in infos]

    t0, c0 = time.monotonic(), cpu_seconds(args.hub_pid)
    rids = {hub.send(p.Register(info=i)) for i in infos}
    while rids:
        reply = hub.recv(30.0)
        if reply is None:
            raise TimeoutError(f"{len(rids)} registrations unanswered after 30s")
        if isinstance(reply.body, p.Error):
            raise RuntimeError(f"registration refused: {reply.body.code}: {reply.body.message}")
        rids.discard(reply.rid)
    register_s = time.monotonic() - t0

    result: dict = {"endpoints": args.endpoints, "tensors": args.tensors, "window": args.window,
                    "protocol": args.protocol}
    for number, phase, depth in ((1, "throughput", args.depth), (2, "latency", 1)):
        m = manifest(args.tensors, args.chunk_mb, rng)
        hub.call(p.Publish(name=names[0], model=MODEL, version=number, manifest=m))
        c0 = cpu_seconds(args.hub_pid)
        wave, elapsed = run_wave(hub, names, depth, args.heartbeat_s, args.timeout_s, args.window,
                                 schedule=args.protocol == "schedule", nchunks=len(m.chunks))
        hub_cpu = cpu_seconds(args.hub_pid) - c0
        result[phase] = {
            "depth": depth, "chunks": len(m.chunks), "seconds": round(elapsed, 3), "replies": wave.replies,
            "plans": wave.plans, "heartbeats": wave.heartbeats, "seed_waits": wave.waits, "errors": wave.errors,
            "ops_per_s": round(wave.replies / elapsed, 1), "hub_cpu_util": round(hub_cpu / elapsed, 3),
            # The hub's CPU for the whole version (every reader holds it): what a planner
            # change must lower. Ops/s alone rewards cheap plans, not finished versions.
            "hub_cpu_s": round(hub_cpu, 3),
            "plan_p50_ms": round(percentile(wave.op_ms.get("plan", []), 0.50), 3),
            "plan_p99_ms": round(percentile(wave.op_ms.get("plan", []), 0.99), 3),
            "op_p50_ms": {op: round(percentile(ms, 0.50), 3) for op, ms in sorted(wave.op_ms.items())},
        }
    status = hub.call(p.Status())
    result.update(
        plan_p50_ms=result["latency"]["plan_p50_ms"],
        plan_p99_ms=result["latency"]["plan_p99_ms"],
        ops_per_s=result["throughput"]["ops_per_s"],
        register_per_s=round(args.endpoints / register_s, 1),
        hub_errors={k: v for k, v in status.counters.items() if k.startswith("errors.")},
        versions=[(v.version, v.state, v.complete_replicas) for v in status.versions],
    )
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
