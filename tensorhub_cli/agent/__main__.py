"""Agent process: ``python -m tensorhub_cli.agent --hub tcp://H:P --node N ...``."""

from __future__ import annotations

import argparse
import logging
import sys

from .daemon import run


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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent[{args.node}] %(levelname)s %(message)s")
    with open(args.token_file, encoding="utf-8") as f:
        token = f.read().strip()
    run(args.hub, token, args.node, args.address, args.dc, args.rack, args.spot, args.heartbeat_s, args.engine)
    logging.info("agent stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
