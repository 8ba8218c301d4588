"""Rollout runner: load the newest version, prove it is that version, generate with it,
repeat.

Protocol of one iteration, in-place (the default; one buffer, veRL-style):

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

``--double-buffer``: two copies of the model (``buffers``). The first version loads as
above; from then on a background thread fetches and checks each newer version into
the spare copy while generation goes on with the active one (still published, so
others read from it), and the iteration starts by swapping the two when one is ready.
The old version is unpublished only when a newer one needs its buffer.

Stall is time the rollout could have generated but waited on weights: in-place, fetches
that moved bytes, and in the ``--barrier N`` baseline (a veRL-style global sync) the
wait until N rollouts hold the version; double-buffered, the first fetch and then only
the swaps. Waiting for the very first version to exist is ``wait_s``, not stall.
``fetch_s`` is the fetch and check, whoever waited on it; ``loop_s`` the fetch's own
loop (planning, transfers, checksums: ``LOOP_STAGES``), without placing memory or the
check. Staleness is the newest version the hub knows minus the one held, at the start
of each generation window.

Events on stdout: ``loaded`` per version (stall, fetch, staleness, bytes, deltas),
``generated`` per window (version, rounds, tokens), ``unpublished`` (double-buffered:
an old version let go, after its swap), ``retry``, ``mismatch``, ``done``. Stops after
loading ``--until-version`` and one generation, at SIGTERM, or after ``--duration-s``.
"""

from __future__ import annotations

import argparse
import logging
import time

from tensorhub_cli.endpoint import FetchError
from tensorhub_cli.hub.client import HubError

from . import model as M
from .buffers import POLL_S, Buffer, Fetcher, check
from .common import add_common, emit, join, model_config, stop_on_signals, wait_for_copies

log = logging.getLogger("tensorhub.rollout")
PROMPTS = [[3, 14, 15, 92], [2, 71, 82, 81], [1, 41, 42, 13]]
MISMATCH = 3
# The fetch loop, placing and checking excluded: what the simulator models (sim.calibrate)
LOOP_STAGES = ("plan_wait_s", "transfer_s", "verify_s")
# Chunks read as deltas, the bytes those took on the wire, and deltas read again in full
DELTA_STATS = ("delta_reads", "delta_wire_bytes", "delta_failed")


def newest(ep, model: str) -> int:
    """The newest READY version (one a rollout could load); 0 when the hub cannot say."""
    try:
        return max((v.version for v in ep.versions(model) if v.state == "READY"), default=0)
    except HubError:
        return 0


def generate(net, seconds: float, new_tokens: int, stopping) -> tuple[int, int]:
    """Greedy rounds over the fixed prompts for ``seconds``: (rounds, tokens)."""
    rounds = tokens = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stopping.is_set():
        for prompt in PROMPTS:
            tokens += len(M.generate(net, prompt, new_tokens))
        rounds += 1
    return rounds, tokens


def loaded(ep, model: str, version: int, previous: int, began: float, stall: float, fetch_s: float, stats: dict,
           wait_s: float, buffers: int) -> None:
    emit("loaded", version=version, previous=previous, began=began, stall_s=stall, fetch_s=fetch_s,
         bytes=stats["bytes"], from_publishers=stats["from_publishers"], corrupt=stats["corrupt"],
         failed=stats["failed"], loop_s=sum(stats.get(k, 0.0) for k in LOOP_STAGES), wait_s=wait_s,
         staleness=max(0, newest(ep, model) - version), probe_ok=True,
         buffers=buffers, **{k: stats.get(k, 0) for k in DELTA_STATS})


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
    r.add_argument("--double-buffer", action="store_true",
                   help="fetch each new version into a second copy of the model while generating with the "
                        "current one, then swap (2x the weights' memory)")
    r.add_argument("--barrier", type=int, default=0, help="baseline: wait until N rollouts hold each version")
    r.add_argument("--barrier-prefix", default="rollout", help="baseline: the rollouts' names start with this")
    args = ap.parse_args(argv)
    if args.barrier and args.double_buffer:
        ap.error("--barrier is the in-place global-sync baseline; it does not go with --double-buffer")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(message)s")
    stopping = stop_on_signals()
    M.deterministic()
    cfg = model_config(args)
    active = Buffer.build(cfg)
    spare = Buffer.build(cfg) if args.double_buffer else None
    ep = join(args, "rollout", reliable=not args.spot, group=args.group)
    emit("started", name=args.name, model=M.describe(cfg, active.net), buffers=2 if spare else 1)
    began, tokens, wait_s = time.monotonic(), 0, 0.0
    fetcher: Fetcher | None = None
    try:
        while not stopping.is_set() and time.monotonic() - began < args.duration_s:
            if fetcher is not None:  # double-buffered, after the first version
                if fetcher.error is not None:
                    raise fetcher.error
                if fetcher.mismatch is not None:
                    emit("mismatch", **fetcher.mismatch)
                    return MISMATCH
                if fetcher.ready is not None:
                    t0, previous = time.monotonic(), active.version
                    active, ready = fetcher.swap(active)
                    stall = time.monotonic() - t0
                    loaded(ep, args.model_name, ready.version, previous, ready.began, stall, ready.fetch_s,
                           ready.stats, wait_s, buffers=2)
                    fetcher.resume()  # (after `loaded`: the old version's unpublish follows its swap)
            else:
                t0, fetch_began = time.monotonic(), time.time()
                try:
                    # wait=False: this loop waits itself, between checks of `stopping`
                    version = ep.fetch(args.model_name, "latest", into=active.into, group=args.group,
                                       timeout=args.fetch_timeout_s, window=args.window, wait=False)
                except HubError as exc:
                    held = active.version
                    if exc.code != "not_found" or time.monotonic() - (t0 if held else began) > args.wait_s:
                        raise
                    stopping.wait(0.05)
                    if held:  # between an in-place trainer's unpublish and its next publish
                        emit("retry", reason="no version READY", began=fetch_began, stall_s=time.monotonic() - t0)
                    else:  # nothing READY yet: not a stall, the trainer has not started
                        wait_s = time.monotonic() - began
                    continue
                except FetchError as exc:  # the version went away mid-fetch: the next one is coming
                    active.version = 0
                    emit("retry", reason=str(exc), began=fetch_began, stall_s=time.monotonic() - t0)
                    continue
                stats = ep.last_fetch
                if version != active.version:
                    bad = check(ep, args.model_name, version, active)
                    if bad:
                        emit("mismatch", **bad)
                        return MISMATCH
                    fetch_s = time.monotonic() - t0
                    if args.barrier:
                        wait_for_copies(ep, args.model_name, version, args.barrier,
                                        lambda name: name.startswith(args.barrier_prefix), stopping,
                                        args.fetch_timeout_s)
                    stall = time.monotonic() - t0
                    loaded(ep, args.model_name, version, active.version, fetch_began, stall, fetch_s, stats, wait_s,
                           buffers=2 if spare else 1)
                    active.version = version
                    if spare is not None:
                        fetcher = Fetcher(ep, args, active, spare, stopping)
                        fetcher.start()
            if args.rollout_s > 0:
                window_began = time.time()
                stale = max(0, newest(ep, args.model_name) - active.version)
                rounds, made = generate(active.net, args.rollout_s, args.new_tokens, stopping)
                tokens += made
                emit("generated", version=active.version, began=window_began, rounds=rounds, tokens=made,
                     staleness=stale)
            elif fetcher is not None:  # (no generation: wait for the fetcher, do not spin)
                stopping.wait(POLL_S)
            if args.until_version and active.version >= args.until_version:
                break
        emit("done", held=active.version, tokens=tokens)
    finally:
        stopping.set()  # (the fetcher stops too)
        if fetcher is not None:
            # A fetch in flight is not interruptible: close fails it (the fetcher is a daemon)
            fetcher.join(timeout=5.0)
        ep.close(drain_timeout=args.drain_timeout_s or 30.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
