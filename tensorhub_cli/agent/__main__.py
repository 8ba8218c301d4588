"""Agent process: ``python -m tensorhub_cli.agent --hub tcp://H:P --node N ...``."""

from __future__ import annotations

import argparse
import logging
import sys

from ..hub.client import HubClient
from .daemon import Agent, agent_info, install_stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tensorhub_cli.agent")
    ap.add_argument("--hub", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--address", required=True, help="this node's address; hub traffic leaves from it")
    ap.add_argument("--dc", default="")
    ap.add_argument("--rack", default="")
    ap.add_argument("--spot", action="store_true")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent[{args.node}] %(levelname)s %(message)s")
    with open(args.token_file, encoding="utf-8") as f:
        token = f.read().strip()
    client = HubClient(args.hub, token, source=args.address)
    agent = Agent(client, agent_info(args.node, args.dc, args.rack, args.spot), args.heartbeat_s)
    install_stop(agent)
    agent.run()
    logging.info("agent stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
