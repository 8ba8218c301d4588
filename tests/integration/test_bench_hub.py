"""`th bench hub` end to end, small: real hub and load-generator processes, JSON out.

Behaviour only (the keys scripts rely on, every simulated reader finishing, nothing
refused, nothing left running); the figures themselves belong in the closing notes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("protocol", ["schedule", "window"])
def test_bench_hub_prints_the_agreed_keys_and_every_reader_completes(protocol):
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "hub", "--json", "--endpoints", "24",
                           # (400 tensors: each phase costs the hub ~0.1 s, well over psutil's
                           # 10 ms CPU tick; at 40 a phase read 0.0 s on a loaded machine)
                           "--tensors", "400", "--chunk-mb", "16", "--timeout", "60", "--protocol", protocol],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["protocol"] == protocol
    assert {"endpoints", "plan_p50_ms", "plan_p99_ms", "ops_per_s"} <= set(r)
    assert r["endpoints"] == 24
    assert 0 < r["plan_p50_ms"] <= r["plan_p99_ms"] and r["ops_per_s"] > 0
    for phase in ("throughput", "latency"):
        assert r[phase]["errors"] == {} and r[phase]["plans"] > 0
        ph = r[phase]  # the version's hub CPU: the utilisation over the wave's time
        assert ph["hub_cpu_s"] > 0
        assert abs(ph["hub_cpu_s"] - ph["hub_cpu_util"] * ph["seconds"]) < 0.01 + 0.01 * ph["hub_cpu_s"]
    assert r["hub_errors"] == {}
    # every simulated endpoint ended holding both versions completely
    assert [tuple(v) for v in r["versions"]] == [(1, "READY", 24), (2, "READY", 24)]
    leftover = subprocess.run(["pgrep", "-f", "tensorhub_cli.bench.hubload|--expiry-s 10 --planner ros"],
                              capture_output=True, text=True)
    assert leftover.stdout == ""


def test_bench_refuses_what_it_cannot_do():
    unknown = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "warp"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown workload 'warp'" in unknown.stderr
    plot = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "hub", "--plot", "x.png"],
                          capture_output=True, text=True)
    assert plot.returncode == 2 and "--plot" in plot.stderr
