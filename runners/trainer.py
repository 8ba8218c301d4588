"""Trainer runner: real optimizer steps on a causal LM; after step s it publishes version s.

Protocol of one step s (contract 3: published bytes never change):

1. forward and backward on the step's batch. These only read the parameters, so
   readers of version s-1 keep reading meanwhile.
2. ``--publish-mode in-place``: unpublish s-1. That returns once every read of the
   parameters has drained (and any retention copy exists), and only then may the
   optimizer write to them. ``snapshot``: nothing to wait for; s-1 lives in a buffer.
3. the optimizer step (AdamW) mutates the parameters in place.
4. the probe (logits of a fixed prompt) is computed from the new weights.
5. publish s: in-place, the parameters themselves; snapshot, a copy in a free buffer
   set from a pool (``--dtype bfloat16``: rounded from the float32 master weights, and
   the probe computed from those rounded weights, as a rollout serves them). In both,
   the probe goes along as one more small tensor.
6. snapshot: versions older than the newest ``--keep`` are unpublished (with drain);
   only then does their buffer set go back to the pool.

``--world W --rank R``: every rank runs the same seeded steps and publishes only its
shard (every W-th parameter from R; the probe with rank 0), shard=(R, W); the hub
makes the version READY once the shards cover the manifest.

``--wait-for-readers N`` is the global-sync baseline: after publishing, the trainer
stops until N complete replicas of the version exist (what a veRL-style sync stage
does). Trainer stall is the time a step spent on weight movement (drain, copy,
publish, and in the baseline the wait), not on compute.

Events on stdout: ``published`` per version (``published_at``: when ``publish``
returned, the version readable from then on), then ``done``; after the last step the
trainer keeps serving until SIGTERM or ``--linger-s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

import torch

from . import model as M
from .common import add_common, emit, join, model_config, stop_on_signals, wait_for_copies

log = logging.getLogger("tensorhub.trainer")


class BufferPool:
    """Host buffer sets shaped like the weights, reused across versions.

    ``take()`` gives a free set (allocating one only when none is free); ``give(v)``
    returns version v's set, which the caller may do only after unpublish(v) returned."""

    def __init__(self, like: dict[str, torch.Tensor]):
        self._like = like
        self._free: list[dict[str, torch.Tensor]] = []
        self._used: dict[int, dict[str, torch.Tensor]] = {}
        self.allocated = 0

    def take(self, version: int) -> dict[str, torch.Tensor]:
        if not self._free:
            self._free.append({n: torch.empty_like(t) for n, t in self._like.items()})
            self.allocated += 1
        buf = self._used[version] = self._free.pop()
        return buf

    def give(self, version: int) -> None:
        self._free.append(self._used.pop(version))


def shard_of(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def slow_optimizer_step(optimizers: list, seconds: float) -> None:
    """One parameter at a time with pauses in between: a step that stays half-done for
    ``seconds``, so a read racing it would see a mix of old and new weights."""
    for opt in optimizers:
        opt.step()
        time.sleep(seconds / len(optimizers))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="runners.trainer", description=__doc__.split("\n")[0])
    add_common(ap)
    t = ap.add_argument_group("training")
    t.add_argument("--steps", type=int, default=5)
    t.add_argument("--publish-mode", choices=["snapshot", "in-place"], default="snapshot")
    t.add_argument("--keep", type=int, default=2, help="snapshot: versions kept published")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--step-s", type=float, default=0.0, help="at least this long per step (paces the run)")
    t.add_argument("--slow-step-s", type=float, default=0.0, help="spread each optimizer step over this long")
    t.add_argument("--rank", type=int, default=0)
    t.add_argument("--world", type=int, default=1)
    t.add_argument("--chunk-mb", type=float, default=4.0)
    t.add_argument("--wait-for-readers", type=int, default=0, help="baseline: block until N complete copies")
    t.add_argument("--linger-s", type=float, default=600.0, help="serve this long after the last step")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    if not 0 <= args.rank < args.world:
        raise SystemExit(f"--rank {args.rank}: must be in [0, --world {args.world})")
    stopping = stop_on_signals()
    M.deterministic()
    cfg = model_config(args)
    if cfg.dtype != "float32" and args.publish_mode != "snapshot":
        raise SystemExit(f"--dtype {cfg.dtype}: the trainer keeps float32 master weights and publishes rounded "
                         "copies, which needs --publish-mode snapshot")
    net = M.build(dataclasses.replace(cfg, dtype="float32")).train()
    served = M.build(cfg) if cfg.dtype != "float32" else None  # the probe's model: the published weights
    params = M.weights(net)
    mine = shard_of(list(params), args.rank, args.world)
    # One optimizer per parameter: AdamW is elementwise, so this is the same update as
    # one optimizer over all, and a slow step can pause between parameters.
    plist = [p for _, p in net.named_parameters()]
    optimizers = [torch.optim.AdamW([p], lr=args.lr) for p in plist] if args.slow_step_s else \
        [torch.optim.AdamW(plist, lr=args.lr)]
    probe = torch.empty_like(M.probe(net))
    dtype = M.DTYPES[cfg.dtype]
    pool = BufferPool({n: params[n].to(dtype) for n in mine}) if args.publish_mode == "snapshot" else None
    ep = join(args, "trainer")
    emit("started", name=args.name, model=M.describe(cfg, net), mode=args.publish_mode, rank=args.rank,
         world=args.world)
    published: list[int] = []  # versions we hold published, newest first
    last = 0  # the newest version published
    chunk = int(args.chunk_mb * (1 << 20))
    try:
        for step in range(1, args.steps + 1):
            if stopping.is_set():
                break
            began = time.monotonic()
            net.zero_grad(set_to_none=True)
            M.loss(net, M.batch(cfg, step)).backward()
            stall = 0.0
            if args.publish_mode == "in-place" and published:
                t0 = time.monotonic()
                # drain before we write
                ep.unpublish(args.model_name, published.pop(), timeout=args.drain_timeout_s or 120.0)
                stall += time.monotonic() - t0
            step_began = time.time()
            if args.slow_step_s:
                slow_optimizer_step(optimizers, args.slow_step_s)
            else:
                for opt in optimizers:
                    opt.step()
            step_ended = time.time()
            if served is not None:
                for n, w in M.weights(served).items():
                    w.copy_(params[n])  # rounded as published
                probe.copy_(M.probe(served))
            else:
                probe.copy_(M.probe(net.eval()))
            net.train()
            t0 = time.monotonic()
            if pool is not None:
                state = pool.take(step)
                for n in mine:
                    state[n].copy_(params[n])
            else:
                state = {n: params[n] for n in mine}
            if args.rank == 0:
                state = {**state, M.PROBE: probe.clone() if pool is not None else probe}
            ep.publish(args.model_name, step, state, shard=(args.rank, args.world), chunk_bytes=chunk)
            published_at = time.time()  # (readable from here: what a rollout's staleness counts from)
            published.insert(0, step)
            last = step
            publish_s = time.monotonic() - t0
            stall += publish_s
            if args.wait_for_readers:
                t0 = time.monotonic()
                wait_for_copies(ep, args.model_name, step, args.wait_for_readers, lambda name: name != ep.name,
                                stopping, timeout=300.0)
                stall += time.monotonic() - t0
            if pool is not None:
                while len(published) > args.keep:
                    old = published.pop()
                    t0 = time.monotonic()
                    ep.unpublish(args.model_name, old, timeout=args.drain_timeout_s or 120.0)
                    stall += time.monotonic() - t0
                    pool.give(old)
            emit("published", version=step, stall_s=stall, publish_s=publish_s, step_began=step_began,
                 step_ended=step_ended, published_at=published_at,
                 step_s=time.monotonic() - began, buffers=pool.allocated if pool else 0)
            rest = args.step_s - (time.monotonic() - began)
            if rest > 0:
                stopping.wait(rest)
        emit("done", versions=last)
        stopping.wait(args.linger_s)
    finally:
        ep.close(drain_timeout=args.drain_timeout_s or 30.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
