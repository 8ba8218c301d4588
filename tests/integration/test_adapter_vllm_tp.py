"""A real TP-2 vLLM engine (``adapters.vllm``) keeps both TP workers on one version of
``latest`` while the trainer publishes between their fetches (contract 2).

One module-scoped world: a hub; a trainer (``vllm_driver trainer``) that publishes on
command; one vLLM engine with ``tensor_parallel_size=2`` (``vllm_driver engine --tp 2``:
its engine core there, one worker process per rank, each rank a TensorHub endpoint of
the group ``vllm-<instance>-dp0``). A gate in each rank (``vllm_driver``'s ``gate`` op)
orders one update's two fetches: rank 0 fetches ``latest`` (v), the trainer publishes
v+1, then rank 1 fetches ``latest``. Both must load v, each rank holding exactly v's
slices of its parameters (checked against v's checkpoint). Versions
alternate between model B (odd) and model A (even): the engine starts from A on disk,
so after an even round it must generate exactly A's tokens again (the model, not only
the staging copies, holds the bytes, on both ranks). The tests run in file order.

Before ``Endpoint.fetch`` resolved with the endpoint's own group (the adapter's fetch
names none), rank 0 loaded v1 and rank 1 v2 in the first round. Now that each rank
reads only its shard (which the hub never counts as a complete copy, so a group's
round would stay open for ``round_timeout_s``), the ranks agree on the version at
``start_weight_update`` over vLLM's own group; without that the second round loaded
v1 again ("the TP ranks loaded [1, 1], not v2 both"). Rank 0 resolves it alone and
broadcasts the resolution, so the hub answers one resolve per update, not one per rank.

The last test has the trainer publish as a real model's proportions would (16 KiB
compaction threshold, 64 KiB chunks): each rank reads its shard (at most 1.05 x its
bytes), before the pause, while the engine generates, and the adapter's pause stages
sum to its pause.
"""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .peers import wait_until
from .test_adapter_vllm import PROMPT, TOKENS, Child
from .test_hub_service import TOKEN, start_hub
from .vllm_driver import make_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def source(version: int) -> str:
    return "B" if version % 2 else "A"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-tp")
    dirs = {"A": base / "A", "B": base / "B"}
    make_model(dirs["A"], seed=1)
    make_model(dirs["B"], seed=2)
    token_file = base / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    hub, client = start_hub(token_file, address, expiry_s=5.0)  # (a busy 2-core machine: beats run late)
    gates = base / "gates"
    gates.mkdir()
    children = []
    try:
        # A real model's proportions at a tiny size: tensors from 16 KiB on chunked where
        # they lie, 64 KiB chunks (a 256 KiB projection is 4 chunks, as a 32 MiB one is 2
        # of the default 16 MiB): a TP reader reads its rows' chunks and its columns' tiles.
        trainer = Child("trainer", "trainer", "--dir", str(dirs["A"]), "--hub", address, "--token-file",
                        str(token_file), "--small-bytes", str(16 << 10), "--chunk-bytes", str(64 << 10))
        engine = Child("TP2", "engine", "--dir", str(dirs["A"]), "--tp", "2")
        children += [trainer, engine]
        for child in children:
            child.ready()
        a_tokens = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        engine.ok("init", init_info={"hub": address, "token_file": str(token_file), "model": "policy",
                                     "name": "tp", "engine": "tcp"})
        assert engine.ok("gate", dir=str(gates)) == [0, 1]
        yield dict(trainer=trainer, engine=engine, dirs=dirs, gates=gates, a=a_tokens,
                   latest=0, updates=0, client=client)
    finally:
        for child in children:
            child.stop()
        client.close()
        stop_child(hub)


def publish(world: dict) -> int:
    v = world["latest"] + 1
    assert world["trainer"].ok("publish", version=v, dir=str(world["dirs"][source(v)])) == v
    world["latest"] = v
    return v


def update_latest(world: dict, publish_between: bool) -> list[dict]:
    """One ``update_weights({"version": "latest"})``: rank 0's fetch, then (optionally)
    a publish, then rank 1's fetch. The ranks' answers (version, group, path, and how
    their shards differ from the checkpoint of that version: not at all)."""
    engine, gates = world["engine"], world["gates"]
    world["updates"] += 1
    n = world["updates"]
    v = world["latest"]
    engine.send("update", update_info={"version": "latest", "timeout": 60.0}, dir=str(world["dirs"][source(v)]))
    (gates / f"rank0-{n}").touch()
    wait_until(lambda: (gates / f"rank0-{n}.done").exists(), 120, f"rank 0's fetch in update {n}")
    if publish_between:
        publish(world)  # READY before rank 1 asks
    (gates / f"rank1-{n}").touch()
    got = engine.answer("update", 180)
    assert "ok" in got, f"update {n} failed: {got.get('error')}\n" + "".join(engine.log[-30:])
    world["loaded"] = got["ok"]["ranks"][0]["version"]
    return got["ok"]["ranks"]


def test_tp_workers_load_one_version_while_newer_ones_are_published_between_their_fetches(world):
    publish(world)
    seen = []
    for _ in range(4):
        v = world["latest"]
        ranks = update_latest(world, publish_between=True)
        seen.append([r["version"] for r in ranks])
        assert seen[-1] == [v, v], f"the TP ranks loaded {seen[-1]}, not v{v} both (updates so far: {seen})"
        assert len({r["group"] for r in ranks}) == 1 and ranks[0]["group"].startswith("vllm-"), ranks
        assert [r["problems"] for r in ranks] == [[], []], f"v{v}: a rank's shard is not {source(v)}'s slice"
        assert [r["path"] for r in ranks] == ["shard", "shard"], ranks
        tokens = world["engine"].ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        assert (tokens == world["a"]) == (source(v) == "A"), f"v{v} is {source(v)}: {tokens} vs A's {world['a']}"
    assert seen == [[v, v] for v in range(1, 5)]


def test_tp_workers_stay_on_one_version_when_latest_is_already_loaded_and_a_newer_lands_between(world):
    v = world["latest"]
    assert [r["version"] for r in update_latest(world, publish_between=False)] == [v, v]
    # Both ranks hold v, the latest: rank 0's update is a no-op on v; v+1 lands; rank 1 asks.
    ranks = update_latest(world, publish_between=True)
    assert [r["version"] for r in ranks] == [v, v], f"the TP ranks loaded {[r['version'] for r in ranks]}"


def test_tp_workers_read_their_own_shard_before_the_pause_while_the_engine_generates(world):
    # start_weight_update starts each rank's read of v into a shadow; the engine
    # generates meanwhile (on the previous weights); the pause is the apply.
    engine, gates = world["engine"], world["gates"]
    before = world["loaded"]
    v = publish(world)
    world["updates"] += 1
    for rank in (0, 1):
        (gates / f"rank{rank}-{world['updates']}").touch()
    resolves = world["client"].call(p.Status()).counters.get("resolves", 0)
    got = engine.ok("update", update_info={"version": v, "timeout": 60.0}, generate=PROMPT,
                    dir=str(world["dirs"][source(v)]))
    assert [r["problems"] for r in got["ranks"]] == [[], []], got["ranks"]
    # Rank 0 resolved for both ranks (``Endpoint.resolve``, broadcast over vLLM's group):
    # neither prefetch named the version at the hub again.
    assert world["client"].call(p.Status()).counters.get("resolves", 0) == resolves + 1
    from safetensors.torch import load_file

    whole = sum(t.nbytes for t in load_file(str(world["dirs"]["A"] / "model.safetensors")).values())
    for rank, m in enumerate(got["metrics"]):
        assert m["version"] == v and m["path"] == "shard" and m["fetch_in_pause"] is False, (rank, m)
        assert 0 < m["bytes"] <= 1.05 * m["shard_bytes"], f"rank {rank} read {m['bytes']} B for a {m['shard_bytes']} B shard"
        assert m["shard_bytes"] < 0.6 * whole, f"rank {rank}'s shard is {m['shard_bytes']} B of a {whole} B model"
        # (vLLM's CPU post-load step, packing each linear layer for oneDNN, ran on
        # stand-ins before the pause: none of it inside)
        assert m["process_s"] == 0.0 and m["prepare_s"] > 0 and m["prepared_s"] > 0, m
        stages = sum(m[s] for s in ("take_s", "load_s", "between_s", "finish_s"))
        assert abs(stages - m["pause_s"]) <= 0.05 * m["pause_s"], m
    if source(before) == "A":  # (generated while the ranks read v: still the previous weights)
        assert got["during"] == world["a"][:8], got["during"]
    tokens = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
    assert (tokens == world["a"]) == (source(v) == "A")


def test_sglangs_map_over_the_real_tp_model_objects_names_the_boxes_vllms_map_names(world):
    """SGLang's side (``layout.sglang_map``: its recording over parameters in their
    loader form, which SGLang's ``begin_weight_update`` makes of its own) run on this
    real vLLM TP-2 engine's model objects, put in their loader form (vLLM's raw
    parameters, their own loaders): SGLang's layers keep these loaders' contract. Each
    rank's every parameter gets the boxes and regions vLLM's own map gives it, and the
    model still serves what it loaded (its parameters put back)."""
    before = world["engine"].ok("generate", prompt=PROMPT, max_tokens=TOKENS)
    for rank, got in enumerate(world["engine"].ok("sglang_probe")):
        assert "unmapped" not in got, (rank, got)
        assert got["differ"] == [] and got["same"] > 0, (rank, got)
        assert got["shard_bytes"][0] == got["shard_bytes"][1], (rank, got)
    assert world["engine"].ok("generate", prompt=PROMPT, max_tokens=TOKENS) == before
