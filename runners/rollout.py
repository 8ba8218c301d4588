"""Rollout runner: load the newest version into the model's own parameters, prove it is
that version, generate with it, repeat.

Protocol of one iteration:

1. fetch ``latest`` (with ``--group``: every member gets the same version, contract 2)
   straight into the parameters, plus a buffer for the version's probe. A version we
   already hold returns at once; a newer one first unpublishes (drains) the old one,
   since it lands in the same memory.
2. check, before generating a single token: every chunk of the parameters re-hashed
   equals the manifest (``Endpoint.verify``), and the probe recomputed from them equals
   the trainer's probe for that version, bit for bit. A mismatch emits ``mismatch`` and
   stops the runner with exit status 3: it never generates with weights it cannot vouch
   for.
3. generate greedily on fixed prompts for ``--rollout-s``.

Stall is time the rollout could have generated but waited on weights: fetches that
moved bytes, and in the ``--barrier N`` baseline (a veRL-style global sync) the wait
until N rollouts hold the version. Waiting for the very first version to exist is
``wait_s``, not stall. Staleness is the newest version the hub knows minus the one
held, at the start of each generation.

Events on stdout: ``loaded`` per version (stall, staleness, bytes), ``mismatch``,
``done``. Stops after loading ``--until-version`` and one generation, at SIGTERM, or
after ``--duration-s``.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from tensorhub_cli.endpoint import FetchError
from tensorhub_cli.hub.client import HubError

from . import model as M
from .common import add_common, emit, join, model_config, stop_on_signals, wait_for_copies

log = logging.getLogger("tensorhub.rollout")
PROMPTS = [[3, 14, 15, 92], [2, 71, 82, 81], [1, 41, 42, 13]]
MISMATCH = 3


def newest(ep, model: str) -> int:
    try:
        return max((v.version for v in ep.versions(model)), default=0)
    except HubError:
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="runners.rollout", description=__doc__.split("\n")[0])
    add_common(ap)
    r = ap.add_argument_group("rollout")
    r.add_argument("--group", default=None)
    r.add_argument("--spot", action="store_true", help="register as a spot (unreliable) endpoint")
    r.add_argument("--rollout-s", type=float, default=0.5, help="generate this long per iteration")
    r.add_argument("--new-tokens", type=int, default=8)
    r.add_argument("--until-version", type=int, default=0)
    r.add_argument("--duration-s", type=float, default=600.0)
    r.add_argument("--wait-s", type=float, default=120.0, help="give up if no version is READY by then")
    r.add_argument("--fetch-timeout-s", type=float, default=120.0)
    r.add_argument("--window", type=int, default=4, help="reads in flight per fetch")
    r.add_argument("--barrier", type=int, default=0, help="baseline: wait until N rollouts hold each version")
    r.add_argument("--barrier-prefix", default="rollout", help="baseline: the rollouts' names start with this")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(message)s")
    stopping = stop_on_signals()
    M.deterministic()
    cfg = model_config(args)
    net = M.build(cfg)
    params = M.weights(net)
    probe = torch.empty_like(M.probe(net))
    into = {**params, M.PROBE: probe}
    ep = join(args, "rollout", reliable=not args.spot, group=args.group)
    emit("started", name=args.name, model=M.describe(cfg, net))
    began, held, tokens, wait_s = time.monotonic(), 0, 0, 0.0
    try:
        while not stopping.is_set() and time.monotonic() - began < args.duration_s:
            t0, fetch_began = time.monotonic(), time.time()
            try:
                # wait=False: this loop waits itself, between checks of `stopping`
                version = ep.fetch(args.model_name, "latest", into=into, group=args.group,
                                   timeout=args.fetch_timeout_s, window=args.window, wait=False)
            except HubError as exc:
                if exc.code != "not_found" or time.monotonic() - (t0 if held else began) > args.wait_s:
                    raise
                stopping.wait(0.05)
                if held:  # between an in-place trainer's unpublish and its next publish
                    emit("retry", reason="no version READY", began=fetch_began, stall_s=time.monotonic() - t0)
                else:  # nothing READY yet: not a stall, the trainer has not started
                    wait_s = time.monotonic() - began
                continue
            except FetchError as exc:  # the version went away mid-fetch: the next one is coming
                emit("retry", reason=str(exc), began=fetch_began, stall_s=time.monotonic() - t0)
                continue
            stats = ep.last_fetch
            if version != held:
                problems = ep.verify(args.model_name, version, into)
                mine = M.probe(net)
                if problems or not torch.equal(mine, probe):
                    diff = float((mine - probe).abs().max()) if mine.shape == probe.shape else float("nan")
                    emit("mismatch", version=version, problems=problems[:5], probe_max_abs_diff=diff)
                    return MISMATCH
                if args.barrier:
                    wait_for_copies(ep, args.model_name, version, args.barrier,
                                    lambda name: name.startswith(args.barrier_prefix), stopping, args.fetch_timeout_s)
                stall = time.monotonic() - t0
                emit("loaded", version=version, previous=held, began=fetch_began, stall_s=stall, bytes=stats["bytes"],
                     from_publishers=stats["from_publishers"], corrupt=stats["corrupt"], failed=stats["failed"],
                     wait_s=wait_s, staleness=max(0, newest(ep, args.model_name) - version), probe_ok=True)
                held = version
            end = time.monotonic() + args.rollout_s
            while time.monotonic() < end and not stopping.is_set():
                for prompt in PROMPTS:
                    tokens += len(M.generate(net, prompt, args.new_tokens))
            if args.until_version and held >= args.until_version:
                break
        emit("done", held=held, tokens=tokens)
    finally:
        ep.close(drain_timeout=args.drain_timeout_s or 30.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
