"""A real TP-2 vLLM engine (``adapters.vllm``) keeps both TP workers on one version of
``latest`` while the trainer publishes between their fetches (contract 2).

Processes: a hub; a trainer (``vllm_driver trainer``) that publishes on command; one
vLLM engine with ``tensor_parallel_size=2`` (``vllm_driver engine --tp 2``: its engine
core here, one worker process per rank, each rank a TensorHub endpoint of the group
``vllm-<instance>-dp0``). A gate in each rank (``vllm_driver``'s ``gate`` op) orders
one update's two fetches: rank 0 fetches ``latest`` (v), the trainer publishes v+1,
then rank 1 fetches ``latest``. Both must load v, with v's bytes. Versions alternate
between model B (odd) and model A (even): the engine starts from A on disk, so after an
even round it must generate exactly A's tokens again (the model, not only the staging
copies, holds the bytes, on both ranks).

Before ``Endpoint.fetch`` resolved with the endpoint's own group (the adapter's fetch
names none), rank 0 loaded v1 and rank 1 v2 in the first round.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .peers import wait_until
from .test_adapter_vllm import PROMPT, TOKENS, Child
from .test_hub_service import TOKEN, start_hub
from .vllm_driver import digest, make_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROUNDS = 4


def state(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_tp_workers_load_one_version_while_newer_ones_are_published_between_their_fetches(tmp_path):
    dirs = {"A": tmp_path / "A", "B": tmp_path / "B"}
    make_model(dirs["A"], seed=1)
    make_model(dirs["B"], seed=2)
    want = {name: digest(state(d)) for name, d in dirs.items()}
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    hub, client = start_hub(token_file, address, expiry_s=5.0)  # (a busy 2-core machine: beats run late)
    gates = tmp_path / "gates"
    gates.mkdir()
    source = lambda v: "B" if v % 2 else "A"  # noqa: E731
    children = []
    try:
        trainer = Child("trainer", "trainer", "--dir", str(dirs["A"]), "--hub", address,
                        "--token-file", str(token_file))
        engine = Child("TP2", "engine", "--dir", str(dirs["A"]), "--tp", "2")
        children += [trainer, engine]
        for child in children:
            child.ready()
        a_tokens = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        engine.ok("init", init_info={"hub": address, "token_file": str(token_file), "model": "policy",
                                     "name": "tp", "engine": "tcp"})
        assert engine.ok("gate", dir=str(gates)) == [0, 1]
        assert trainer.ok("publish", version=1, dir=str(dirs[source(1)])) == 1
        seen = []
        for n in range(1, ROUNDS + 1):
            v = n  # latest when the round starts
            engine.send("update", update_info={"version": "latest", "timeout": 60.0})
            (gates / f"rank0-{n}").touch()
            wait_until(lambda: (gates / f"rank0-{n}.done").exists(), 120, f"rank 0's fetch in round {n}")
            # Rank 0 has resolved and fetched v: a newer version turns READY before rank 1 asks.
            assert trainer.ok("publish", version=v + 1, dir=str(dirs[source(v + 1)])) == v + 1
            (gates / f"rank1-{n}").touch()
            got = engine.answer("update", 180)
            assert "ok" in got, f"round {n}: update failed: {got.get('error')}\n" + "".join(engine.log[-30:])
            ranks = got["ok"]["ranks"]
            seen.append([r["version"] for r in ranks])
            assert [r["version"] for r in ranks] == [v, v], f"round {n}: the TP ranks loaded {seen[-1]}, not v{v} both"
            assert len({r["group"] for r in ranks}) == 1 and ranks[0]["group"].startswith("vllm-"), ranks
            assert [r["digest"] for r in ranks] == [want[source(v)]] * 2, f"round {n}: wrong bytes in a rank's staging"
            tokens = engine.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
            assert (tokens == a_tokens) == (source(v) == "A"), f"round {n} (v{v} is {source(v)}): {tokens} vs A's {a_tokens}"
        assert seen == [[n, n] for n in range(1, ROUNDS + 1)]
    finally:
        for child in children:
            child.stop()
        client.close()
        stop_child(hub)
