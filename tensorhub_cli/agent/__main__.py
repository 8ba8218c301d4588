"""Agent process: ``python -m tensorhub_cli.agent --hub tcp://H:P --node N ...``.

Flags map one to one onto ``daemon.run``; the launcher (``th up``) passes the node's
place and the spec's ``hub.heartbeat_s`` and ``endpoints`` timeouts. Runs until a
signal (see ``daemon``), then exits 0; exits 1 naming the store when another live
agent uses its store directory; exits 2 naming the file when the token file is missing,
unreadable or empty.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import BadArgument
from ..tokens import read_token_file
from .daemon import run
from .store import StoreError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorhub_cli.agent")
    ap.add_argument("--hub", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--address", required=True, help="this node's address; all its traffic leaves from it")
    ap.add_argument("--dc", default="")
    ap.add_argument("--rack", default="")
    ap.add_argument("--spot", action="store_true")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--engine", choices=("nixl", "tcp"), default="nixl")
    # The cluster spec's ``endpoints`` section; defaults match the endpoint's.
    ap.add_argument("--read-timeout-s", type=float, default=30.0, help="one chunk read before it is re-planned")
    ap.add_argument("--plan-timeout-s", type=float, default=5.0, help="one plan round trip to the hub")
    ap.add_argument("--drain-timeout-s", type=float, default=120.0,
                    help="per copy, on failover (SIGUSR1): its drain and retention copy elsewhere")
    ap.add_argument("--connect-timeout-s", type=float, default=3600.0, help="until the hub accepts our registration")
    ap.add_argument("--store", default=None,
                    help="base directory of the copies that outlive the agent (default $TH_AGENT_STORE, "
                         "else /dev/shm/tensorhub)")
    ap.add_argument("--ucx-net-devices", default=None,
                    help="UCX_NET_DEVICES: one NIC, or ';'-joined NICs one per GPU (`th` passes the node's)")
    ap.add_argument("--cluster", default=None, help="names our directory in the store (default hub-<port>)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent[{args.node}] %(levelname)s %(message)s")
    try:
        token = read_token_file(args.token_file)
    except BadArgument as exc:
        logging.error("%s", exc)
        return 2
    from ..engines.nixl_shim import use_net_devices

    use_net_devices(args.ucx_net_devices)  # before the endpoint's engine loads NIXL
    try:
        run(args.hub, token, args.node, args.address, args.dc, args.rack, args.spot, args.heartbeat_s, args.engine,
            read_timeout_s=args.read_timeout_s, plan_timeout_s=args.plan_timeout_s,
            drain_timeout_s=args.drain_timeout_s, connect_timeout_s=args.connect_timeout_s, store=args.store,
            cluster=args.cluster)
    except StoreError as exc:
        logging.error("%s", exc)
        return 1
    logging.info("agent stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
