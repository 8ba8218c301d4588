"""Benchmarks and tests on the network-namespace testbed (``scripts/testbed``).

``testbed(n, ...)`` brings one up (root only), yields its recorded state and always
tears it down, also after a failure. ``Site`` says where a process of a benchmark
runs: on loopback, or inside a testbed node through ``nsenter`` with the node's
address, rack and DC as its endpoint's place.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "testbed"
# scripts/testbed's logic, run by the interpreter that runs us (it needs psutil, which
# ours has however `th` was installed; the script's own pick is the repo's .venv or python3).
_KIT_MAIN = "import sys; sys.path.insert(0, sys.argv.pop(1)); from testbed_kit.main import main; sys.exit(main())"


def kit(*args: str) -> list[str]:
    """The argv of ``scripts/testbed ARGS…`` run by ``sys.executable``."""
    return [sys.executable, "-c", _KIT_MAIN, str(SCRIPT.parent), *args]


class TestbedError(RuntimeError):
    pass


def unavailable() -> str | None:
    """Why a testbed cannot be built here, or None if it can."""
    if not SCRIPT.exists():
        return f"{SCRIPT} is missing (the testbed needs a source checkout)"
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if not shutil.which(tool):
            return f"`{tool}` is not installed"
    probe = subprocess.run(["ip", "netns", "add", "thtb-probe"], capture_output=True, text=True, timeout=10)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "thtb-probe"], capture_output=True, timeout=10)
    return None


def _script(*args: str, timeout: float) -> str:
    try:
        done = subprocess.run(kit(*args), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TestbedError(f"scripts/testbed {' '.join(args)} did not finish within {timeout:.0f}s") from None
    if done.returncode != 0:
        raise TestbedError(f"scripts/testbed {' '.join(args)} failed: "
                           f"{(done.stderr.strip() or done.stdout.strip())[-1500:]}")
    return done.stdout


LOCK = Path("/run/tensorhub-testbed.lock")


@contextlib.contextmanager
def _exclusive(wait_s: float):
    """Hold the machine's testbed lock: one testbed exists at a time (its namespace
    names are fixed), and ``down`` would tear down another run's nodes under it."""
    with open(LOCK, "a+") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TestbedError(f"another testbed run held {LOCK} for {wait_s:.0f}s; "
                                       "wait for it, or `scripts/testbed down` if it is gone") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def testbed(nodes: int, *flags: str, timeout: float = 300, wait_s: float = 1800):
    """``scripts/testbed up NODES FLAGS… --json`` → its state; ``down`` on the way out.
    Another run's testbed is waited for (up to ``wait_s``), never torn down."""
    why = unavailable()
    if why:
        raise TestbedError(why)
    with _exclusive(wait_s):
        try:
            state = json.loads(_script("up", str(nodes), *flags, "--json", timeout=timeout).splitlines()[-1])
            yield state
        finally:
            _script("down", timeout=120)


def enter(node: str) -> list[str]:
    """The argv prefix that runs a command inside ``node``, in the caller's working
    directory: ``scripts/testbed exec``, which becomes ``nsenter``."""
    return kit("exec", node, "--")


def node_counters(state: dict, node: str) -> dict[str, int]:
    """Kernel byte counters of ``node``'s eth0 (what actually crossed its link)."""
    ns = next(n["ns"] for n in state["nodes"] if n["name"] == node)
    return _counters(ns, "eth0")


def link_counters(state: dict, kind: str, name: str) -> dict[str, int]:
    """Counters of the upper end of link ``kind`` below ``name`` (e.g. ``dc``, ``dc2``):
    ``tx_bytes`` there is what went *down* into ``name``, ``rx_bytes`` what came up."""
    link = next(lk for lk in state["links"] if lk["kind"] == kind and lk["a_ns"] == f"thtb-{name}")
    return _counters(link["b_ns"], link["b_if"])


def _counters(ns: str, dev: str) -> dict[str, int]:
    base = f"/sys/class/net/{dev}/statistics"
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"{base}/tx_bytes", f"{base}/rx_bytes"],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    tx, rx = (int(x) for x in out.split())
    return {"tx_bytes": tx, "rx_bytes": rx}


@dataclass
class Site:
    """Where a benchmark's processes run. ``state`` None: loopback."""

    state: dict | None = None

    def prefix(self, node: str) -> list[str] | None:
        return enter(node) if self.state else None

    def place(self, node: str) -> list[str]:
        """Endpoint flags (``bench.peer.arguments``) that put a process on ``node``."""
        if not self.state:
            return []
        n = next(n for n in self.state["nodes"] if n["name"] == node)
        return ["--host", n["address"], "--node", node, "--rack", n["rack"], "--dc", n["dc"]]

    def sent(self, node: str) -> int:
        """Bytes ``node`` has sent over its link so far (0 on loopback)."""
        return node_counters(self.state, node)["tx_bytes"] if self.state else 0

    def address(self, node: str) -> str:
        if not self.state:
            return "127.0.0.1"
        return next(n["address"] for n in self.state["nodes"] if n["name"] == node)
