"""`th bench hub`: the real hub process under a load-generator process.

The hub is pinned to one core and the generator to the others (when there are
others), so ``ops_per_s`` is what one hub core sustains, and the hub's CPU use per
phase says whether it, and not the generator, was the limit. Both processes are
stopped by PID whatever happens. ``--profile FILE`` runs the hub under cProfile.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

from ..hub.client import HubUnreachable, wait_for_hub
from ..launch.procs import stop_child

TARGET = {"plan_p99_ms": 5.0, "ops_per_s": 10_000}


class BenchError(Exception):
    pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned(cpus: set[int]):
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def run(endpoints: int = 1000, tensors: int = 1000, chunk_mb: int = 64, depth: int = 64, planner: str = "ros",
        timeout_s: float = 600.0, profile: Path | None = None, window: int = 32, protocol: str = "schedule") -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    hub_cpus, load_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(), set())
    with tempfile.TemporaryDirectory(prefix="th-bench-hub-") as tmp:
        token = secrets.token_hex(16)
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        address = f"tcp://127.0.0.1:{_free_port()}"
        runner = ["-m", "cProfile", "-o", str(profile)] if profile else []
        hub_log = open(Path(tmp) / "hub.log", "w+b")
        hub = subprocess.Popen([sys.executable, *runner, "-m", "tensorhub_cli.hub", "--bind", address,
                                "--token-file", str(token_file), "--expiry-s", "10", "--planner", planner],
                               stdout=hub_log, stderr=subprocess.STDOUT, preexec_fn=_pinned(hub_cpus))
        try:
            wait_for_hub(address, token, timeout=30, alive=lambda: hub.poll() is None)
            load = subprocess.run(
                [sys.executable, "-m", "tensorhub_cli.bench.hubload", "--address", address, "--token-file",
                 str(token_file), "--hub-pid", str(hub.pid), "--endpoints", str(endpoints), "--tensors",
                 str(tensors), "--chunk-mb", str(chunk_mb), "--depth", str(depth), "--timeout-s", str(timeout_s),
                 "--window", str(window), "--protocol", protocol],
                capture_output=True, text=True, timeout=timeout_s + 60, preexec_fn=_pinned(load_cpus))
        except HubUnreachable as exc:
            hub_log.seek(0)
            raise BenchError(f"{exc}; hub log:\n{hub_log.read().decode(errors='replace')[-2000:]}") from None
        except subprocess.TimeoutExpired:
            raise BenchError(f"load generator did not finish within {timeout_s + 60:.0f}s") from None
        finally:
            stop_child(hub)
            hub_log.close()
    if load.returncode != 0:
        raise BenchError(f"load generator failed (exit {load.returncode}):\n{load.stderr[-2000:]}")
    result = json.loads(load.stdout)
    # Figures from a run in which the hub refused anything count for nothing.
    refused = result["hub_errors"] or any(result[phase]["errors"] for phase in ("throughput", "latency"))
    result.update(planner=planner, hub_cpus=sorted(hub_cpus), load_cpus=sorted(load_cpus), target=TARGET,
                  target_met=not refused and result["plan_p99_ms"] <= TARGET["plan_p99_ms"]
                  and result["ops_per_s"] >= TARGET["ops_per_s"])
    return result
