"""What both runners share: joining the cluster, model flags, and the event stream.

Each runner writes one JSON object per line on stdout for every event (``published``,
``loaded``, ``failed``, ``done``); ``th bench rl`` and the tests read those lines, so
what a runner did is data, not log text. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from tensorhub_cli import connect

from .model import ModelConfig


def add_common(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("cluster")
    g.add_argument("--hub", help="tcp://HOST:PORT (with --token-file), or use --cluster")
    g.add_argument("--token-file", type=Path)
    g.add_argument("--cluster", help="a cluster started by `th up` (hub, token, place from its state)")
    g.add_argument("--name", required=True)
    g.add_argument("--node", required=True)
    g.add_argument("--host", default="127.0.0.1", help="address to bind and send from (with --hub)")
    g.add_argument("--dc", default="")
    g.add_argument("--rack", default="")
    g.add_argument("--engine", default=None, help="nixl or tcp (default: the cluster's)")
    g.add_argument("--ucx-net-devices", default=None,
                   help="UCX_NET_DEVICES: one NIC, or ';'-joined NICs one per GPU (`th` passes the node's)")
    g.add_argument("--model-name", default="policy")
    g.add_argument("--heartbeat-s", type=float, default=0.5)
    g.add_argument("--read-timeout-s", type=float, default=None,
                   help="one chunk read before it is re-planned (default: the cluster spec's, else 30)")
    g.add_argument("--plan-timeout-s", type=float, default=None,
                   help="one plan round trip to the hub (default: the cluster spec's, else 5)")
    g.add_argument("--drain-timeout-s", type=float, default=None,
                   help="an unpublish drain (and retention copy) at close or before the trainer writes; "
                        "default: 30 s at close, 120 s before a write")
    m = ap.add_argument_group("model (must match on every runner)")
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--vocab", type=int, default=2048)
    m.add_argument("--seq", type=int, default=64)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--arch", default="auto", choices=["auto", "llama", "torch"])
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the published weights' dtype (a bfloat16 trainer trains float32 master weights)")


def model_config(args) -> ModelConfig:
    return ModelConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, seq=args.seq,
                       seed=args.seed, arch=args.arch, dtype=args.dtype)


def join(args, role: str, reliable: bool = True, group: str | None = None):
    from tensorhub_cli.engines.nixl_shim import use_net_devices

    use_net_devices(args.ucx_net_devices)  # before the first engine loads NIXL
    common = dict(name=args.name, node=args.node, role=role, reliable=reliable, group=group,
                  heartbeat_s=args.heartbeat_s)
    if args.engine:
        common["engine"] = args.engine
    for key in ("read_timeout_s", "plan_timeout_s"):  # unset: connect's (the spec's, with --cluster)
        if getattr(args, key) is not None:
            common[key] = getattr(args, key)
    if args.cluster:
        return connect(cluster=args.cluster, **common)
    if not args.hub or not args.token_file:
        raise SystemExit("give --cluster NAME, or --hub tcp://HOST:PORT with --token-file")
    return connect(hub=args.hub, token=args.token_file.read_text().strip(), host=args.host, dc=args.dc,
                   rack=args.rack, **common)


def emit(event: str, **fields) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def wait_for_copies(ep, model: str, version: int, copies: int, counts, stopping: threading.Event,
                    timeout: float) -> None:
    """The global-sync baseline's barrier: block until ``copies`` holders whose name
    ``counts`` accepts hold all of ``model@version`` (polling the hub), or raise."""
    deadline = time.monotonic() + timeout
    while not stopping.is_set():
        holders = next((v.holders for v in ep.versions(model) if v.version == version), [])
        if sum(h.complete for h in holders if counts(h.name)) >= copies:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{model}@{version}: {copies} complete copies did not appear within {timeout:.0f}s")
        time.sleep(0.01)


def stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT set the event: the runner finishes its step, closes, exits 0."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    return stopping
