"""`th bench hub --replay`: the same plans every run, whatever the hash seed; every
reader completes; a refusal or bad input is named, not measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tensorhub_cli.bench import hubreplay
from tensorhub_cli.hub import protocol as p

SMALL = dict(endpoints=24, tensors=20, chunk_mb=16)


def test_a_replay_plans_the_same_every_run_and_every_reader_completes():
    a, b = hubreplay.run(**SMALL), hubreplay.run(**SMALL)
    assert a["plans_digest"] == b["plans_digest"]
    for key in ("v1", "v2"):
        assert a[key]["ops"] == b[key]["ops"] and a[key]["plans"] > a[key]["waits"] >= 0
        assert a[key]["ops"]["resolve"] == 23 and a[key]["hub_cpu_s"] > 0
    assert [tuple(v) for v in a["versions"]] == [(1, "READY", 24), (2, "READY", 24)]
    # The digest is of the plans: the star baseline plans every read from the trainer.
    star = hubreplay.run(planner="star", **SMALL)
    assert star["plans_digest"] != a["plans_digest"]
    assert [tuple(v) for v in star["versions"]] == [(1, "READY", 24), (2, "READY", 24)]


def test_the_digest_does_not_depend_on_the_hash_seed():
    # Sets of names iterate in hash order; the planner must not let that order decide.
    code = ("from tensorhub_cli.bench import hubreplay; "
            "print(hubreplay.run(endpoints=24, tensors=20, chunk_mb=16)['plans_digest'])")
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout.strip()
               for seed in ("1", "2")}
    assert len(digests) == 1 and "" not in digests


def test_a_refused_op_stops_the_replay_naming_it():
    rp = hubreplay.Replay("ros", op_s=1e-4)
    try:
        rp.token = "not-the-token"
        with pytest.raises(hubreplay.ReplayError, match="refused Heartbeat from ep0: auth"):
            rp.call(hubreplay.Phase(), "heartbeat", p.Heartbeat(name="ep0"))
    finally:
        rp.close()


def test_replay_refuses_an_option_it_does_not_use():
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "hub", "--replay", "--depth", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--depth does not apply to --replay" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "hub", "--replay", "--json",
                           "--endpoints", "12", "--tensors", "8", "--chunk-mb", "16"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["mode"] == "replay"


def test_a_scheduled_reader_costs_the_hub_a_handful_of_ops_not_one_per_window():
    sched = hubreplay.run(protocol="schedule", **SMALL)
    window = hubreplay.run(protocol="window", window=4, **SMALL)
    readers = SMALL["endpoints"] - 1
    for key in ("v1", "v2"):
        # a schedule, then a report per quarter of the chunks at most
        assert sched[key]["plans"] <= 5 * readers, sched[key]["ops"]
        assert "progress" not in sched[key]["ops"]
        assert window[key]["plans"] + window[key]["ops"].get("progress", 0) > 2 * sched[key]["plans"]
    assert [tuple(v) for v in sched["versions"]] == [(1, "READY", 24), (2, "READY", 24)]
