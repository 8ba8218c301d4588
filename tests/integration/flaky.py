"""A stand-in runner for supervisor tests: ``python -m tests.integration.flaky``.

Each start appends a line to ``--counter``. The first ``--fail-times`` starts exit with
``--code``, ``--crash-after-s`` after starting (and after registering as endpoint ``--name`` at ``--hub`` if given, so the hub
has a live endpoint to lose); later starts register too, then stay until SIGTERM
(exit 0) or, with ``--finish``, exit 0 at once.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counter", type=Path, required=True)
    ap.add_argument("--fail-times", type=int, default=0)
    ap.add_argument("--code", type=int, default=1)
    ap.add_argument("--finish", action="store_true")
    ap.add_argument("--hub")
    ap.add_argument("--token-file", type=Path)
    ap.add_argument("--name", default="flaky")
    ap.add_argument("--crash-after-s", type=float, default=0.0, help="a failing start lives this long first")
    args, _ = ap.parse_known_args()  # a runner gets place and timeout flags it does not need
    with open(args.counter, "a") as f:
        f.write(f"{os.getpid()} {os.environ.get('TH_INCARNATION', '')}\n")
    starts = len(args.counter.read_text().splitlines())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ep = None
    if args.hub:
        from tensorhub_cli import connect

        ep = connect(hub=args.hub, token=args.token_file.read_text().strip(), name=args.name, engine="tcp", heartbeat_s=0.2,
                     connect_timeout=20)
        print(f"registered {ep.name} incarnation {ep.incarnation}", flush=True)
    if starts <= args.fail_times:
        time.sleep(args.crash_after_s)
        os._exit(args.code)  # a crash: no deregistration, no cleanup
    if not args.finish:
        stop.wait(120)
    if ep is not None:
        ep.close(drain_timeout=0)


if __name__ == "__main__":
    main()
