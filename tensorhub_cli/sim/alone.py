"""The hub alone: a simulated run's hub calls replayed in a process that holds nothing else.

Protocol: ``cpu_s(log)`` → CPU seconds (``run``: with the replayed hub's counters).
``log`` is ``HubServer.log(mark)`` of a run whose hub recorded (``HubServer(record=True)``):
``(config, calls, since)``, every queue entry the simulated hub served, in order, with
its simulated time (and each plan's arrival, which counts as a heartbeat). A fresh
interpreter (``python -m tensorhub_cli.sim.alone``, the log pickled on its stdin,
bounded by ``TIMEOUT_S``) builds a ``Hub`` from ``config``, applies every entry as
``HubServer`` does, and prints the process CPU that ``calls[since:]`` took (a version's
share: the setup is replayed, not counted). Errors (a replay that fails or runs out of
time) raise ``RuntimeError`` with the child's own message.

Why. In a run, other work comes between two hub calls (the simulator's walk over
flows, events and reader tables), and a call that follows other work runs with the
hub's state out of the caches, in whichever process the hub sits (``sim.hubhost``,
"Warm and cold": a version's calls at 4,096 rollout GPUs, 2026-12-07, were charged
0.92 CPU-s in the simulator's process, 1.00 in a process of their own that slept
between calls and 0.60 in one kept awake, against 0.29–0.34 replayed here). The
replay runs the calls back to back with the caches to itself: the hub on a node of
its own, the lower bound of what the run charges. It is the hub's work only: no
socket, no codec (``hub.request_overhead_s`` models those), and its string hashes are not the
simulator's, so where the hub walks a set its answers may come in another order (the
requests are the same).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

TIMEOUT_S = 600.0


def cpu_s(log: tuple) -> float:
    return run(log)["cpu_s"]


def run(log: tuple) -> dict:
    """``cpu_s``, and the replayed hub's ``counters`` at the end (the run's, where the
    replay took the same decisions)."""
    try:
        done = subprocess.run([sys.executable, "-m", "tensorhub_cli.sim.alone"], input=pickle.dumps(log),
                              capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"replaying {len(log[1])} hub calls alone took over {TIMEOUT_S:.0f}s") from None
    if done.returncode != 0:
        raise RuntimeError(f"replaying the hub's calls alone failed: {done.stderr.decode(errors='replace')[-2000:]}")
    return json.loads(done.stdout)


def replay(config, calls: list, since: int) -> tuple[float, dict]:
    """(In the child.) The CPU ``calls[since:]`` take on a fresh hub, and its counters."""
    from ..hub.machine import Hub
    from .hubserver import HubServer

    server = HubServer.alone(Hub(config, now=0.0))
    spent = 0.0
    for i, (entry, now) in enumerate(calls):
        t0 = time.process_time()
        if server.replay(entry, now) and i >= since:
            spent += time.process_time() - t0
    return spent, server.counters


if __name__ == "__main__":
    config, calls, since = pickle.loads(sys.stdin.buffer.read())
    spent, counters = replay(config, calls, since)
    print(json.dumps({"cpu_s": spent, "counters": counters}))
