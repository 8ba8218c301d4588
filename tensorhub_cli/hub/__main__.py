"""Hub process: ``python -m tensorhub_cli.hub --bind tcp://ADDR:PORT --token-file F``.

Exits 0 on SIGTERM/SIGINT after closing its socket; exits 1 with a one-line message
when it cannot bind (port taken, address not local); exits 2 naming the file when the
token file is missing, unreadable or empty (``tokens.read_token_file``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

import zmq

from ..errors import BadArgument
from ..tokens import read_token_file
from .service import HubService
from .deltas import MODES
from .retention import Policy
from .machine import Hub, HubConfig
from .mustering import MUSTER_S


def hub_config(args) -> HubConfig:
    policies = {}
    for item in args.retain:
        model, _, rule = item.partition("=")
        keep, _, least = rule.partition(":")
        policies[model] = Policy(keep_latest=int(keep), min_reliable_copies=int(least))
    deltas, default = {}, "remote"
    for item in args.deltas:
        model, _, mode = item.rpartition("=")
        if mode not in MODES:
            raise SystemExit(f"hub: --deltas {item!r}: the mode must be one of {', '.join(MODES)}")
        if model:
            deltas[model] = mode
        else:
            default = mode
    if not 0 <= args.muster_s <= 10:
        raise SystemExit(f"hub: --muster-s {args.muster_s}: must be between 0 and 10 seconds")
    return HubConfig(cluster=args.cluster, expiry_s=args.expiry_s, round_timeout_s=args.round_timeout_s,
                     planner=args.planner, policies=policies, deltas=deltas, default_deltas=default,
                     muster_s=args.muster_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorhub_cli.hub")
    ap.add_argument("--bind", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--cluster", default="tensorhub")
    ap.add_argument("--expiry-s", type=float, default=5.0,
                    help="an endpoint not heard from for longer is dropped (the spec's hub.expiry_s)")
    ap.add_argument("--round-timeout-s", type=float, default=120.0,
                    help="a group round ends after this long even if a member never completes")
    ap.add_argument("--metrics-port", type=int, default=None)
    ap.add_argument("--metrics-addr", default="127.0.0.1")
    ap.add_argument("--retain", action="append", default=[], metavar="MODEL=KEEP:MIN",
                    help="retention policy of a model: keep_latest and min_reliable_copies")
    ap.add_argument("--planner", choices=("ros", "star"), default="ros")
    ap.add_argument("--muster-s", type=float, default=MUSTER_S,
                    help="a new swarm's first readers that ask within this long are laid out together, "
                         "sorted by rack and node (0: each placed as it asks)")
    ap.add_argument("--deltas", action="append", default=[], metavar="[MODEL=]MODE",
                    help="reads sent as deltas: off, remote (across DC links; the default) or all; "
                         "MODEL= sets one model's (the spec's models[].deltas)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s hub %(levelname)s %(message)s")
    try:
        token = read_token_file(args.token_file)
    except BadArgument as exc:
        print(f"hub: {exc}", file=sys.stderr)
        return 2
    hub = Hub(hub_config(args), now=time.monotonic())
    try:
        service = HubService(hub, token, args.bind)
    except zmq.ZMQError as exc:
        print(f"hub: cannot bind {args.bind}: {exc}", file=sys.stderr)
        return 1
    if args.metrics_port:
        from .metrics import serve_metrics

        serve_metrics(service.status, args.metrics_addr, args.metrics_port)
    logging.info("hub for cluster %s listening on %s", args.cluster, args.bind)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await service.serve(stop)

    asyncio.run(run())
    logging.info("hub stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
