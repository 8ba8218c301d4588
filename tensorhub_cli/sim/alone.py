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

Why. Inside the simulator the hub's calls share the process, and its caches, with
every flow, event and reader table, which the simulator walks between two hub calls;
a hub process holds only its state. A whole run's calls (setup included) cost
0.34–0.36 CPU-s replayed alone against 0.95 charged in the run at 4,096 rollout GPUs
(plans: 0.24 against 0.87; 2026-12-07, two replays), 0.11 against 0.15 at 1,024
(plans: 0.047 against 0.095): the charged figure grows with the simulator's heap, not
only with the hub's work. The replay is the hub's work only: no socket, no
codec (``hub.request_overhead_s`` models those), and its string hashes are not the
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
    return spent, dict(server.hub.counters)


if __name__ == "__main__":
    config, calls, since = pickle.loads(sys.stdin.buffer.read())
    spent, counters = replay(config, calls, since)
    print(json.dumps({"cpu_s": spent, "counters": counters}))
