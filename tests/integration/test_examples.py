"""``examples/vllm_two_engines.py`` runs any number of times on one cluster: each run
publishes one above the newest version the hub holds (its publish step, without vLLM;
an endpoint that stays stands for the agent's retention copy of an earlier run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tensorhub_cli.endpoint import connect
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_two_engines.py"


def example():
    spec = importlib.util.spec_from_file_location("vllm_two_engines", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (imports nothing heavy: vLLM only inside main)
    return module


def test_each_run_publishes_after_the_newest_version_held(token_file):
    next_version = example().next_version
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    kept = []
    try:
        for run in range(4):  # other bytes every run: a "trained" model
            ep = connect(address, TOKEN, name="example-trainer", engine="tcp", heartbeat_s=0.2)
            kept.append(ep)
            version = next_version(ep, "policy")
            ep.publish("policy", version, {"w": torch.full((1024,), float(run))})
            assert version == run + 1
            copy = connect(address, TOKEN, name=f"copy-{run}", engine="tcp", heartbeat_s=0.2)
            kept.append(copy)  # the retention copy an agent keeps once the trainer leaves
            copy.fetch("policy", version, into={"w": torch.zeros(1024)}, timeout=30)
            ep.close(drain_timeout=10)
        held = [v.version for v in kept[-1].versions("policy")]
        assert held == [3, 4], held  # keep_latest (2) of four runs
    finally:
        for ep in kept:
            ep.close(drain_timeout=0)
        client.close()
        stop_child(proc)
