"""verl's checkpoint engine "tensorhub" against the real verl package (0.9.1).

The trainer and the rollout are separate processes (``verl_driver``), each building the
engine through verl's registry after importing our module as ``custom_backend_module``
does. Tests needing verl skip where it is not installed (see requirements/verl.txt for
how CI installs it); the ImportError test runs everywhere.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from tensorhub_cli.bench.rig import Driven, HubProcess
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient

from ..conftest import REPO
from .peers import wait_until

pytestmark = pytest.mark.integration


def driver(role: str, hub: HubProcess, *extra: str, env: dict | None = None) -> Driven:
    return Driven(f"verl-{role}", ["-m", "tests.integration.verl_driver", "--role", role, "--hub", hub.address,
                                   "--token-file", str(hub.token_file), *extra], cwd=str(REPO), env=env)


def holds(client: HubClient, prefix: str) -> set[int]:
    """The versions the hub lists an endpoint named ``prefix...`` as a holder of."""
    return {v.version for v in client.call(p.Versions(model="policy")).versions
            if any(h.name.startswith(prefix) for h in v.holders)}


def trainer_holds(client: HubClient) -> set[int]:
    return holds(client, "verl-trainer-")


def test_steps_move_bit_exact_through_two_alternating_buffer_sets(tmp_path):
    """Steps 0, 1, 2 (a PPO run's first syncs: step 0 is the initial weights) are
    versions 1, 2, 3."""
    pytest.importorskip("verl")
    with HubProcess(expiry_s=2.0) as hub:
        client = HubClient(hub.address, hub.token)
        trainer, rollout = driver("trainer", hub), driver("rollout", hub, "--receive-timeout-s", "3")
        try:
            assert trainer.hello["cls"] == rollout.hello["cls"] == "TensorHubCheckpointEngine"
            s1 = trainer.ask("send", step=0, seed=1)
            assert s1["metrics"]["checkpoint_engine/version"] == 1 and s1["metrics"]["checkpoint_engine/tensors"] == 4
            assert trainer_holds(client) == {1}

            # Step 1 stops halfway through filling the second set: version 1 stays published
            # and is read from the trainer meanwhile; version 2 is not visible yet.
            gate = tmp_path / "gate"
            trainer.send("send", step=1, seed=2, gate=str(gate))
            wait_until(lambda: Path(f"{gate}.reached").exists(), 60, "the trainer halfway through step 1")
            r1 = rollout.ask("receive", step=0, seed=1)
            assert r1["equal"] and r1["version"] == 1
            assert trainer_holds(client) == {1}
            assert 2 not in {v.version for v in client.call(p.Versions(model="policy")).versions}
            gate.touch()
            s2 = trainer.recv(60)
            assert "error" not in s2, s2
            assert trainer_holds(client) == {1, 2}
            r2 = rollout.ask("receive", step=1, seed=2)
            assert r2["equal"] and r2["version"] == 2

            # Step 2 unpublishes version 1 and writes into its buffers: never more than two held.
            s3 = trainer.ask("send", step=2, seed=3)
            assert s3["ptrs"] == s1["ptrs"] and set(s2["ptrs"]).isdisjoint(s1["ptrs"])
            assert trainer_holds(client) == {2, 3}
            r3 = rollout.ask("receive", step=2, seed=3)
            assert r3["equal"] and r3["version"] == 3

            # verl re-syncs a step without training between: same bytes are not republished;
            # other bytes under a published step are refused.
            assert trainer.ask("send", step=2, seed=3)["metrics"]["checkpoint_engine/resent"] == 1.0
            trainer.send("send", step=2, seed=4)
            refused = trainer.recv(60)
            assert refused["type"] == "EndpointError", refused
            assert "global_steps=2 was already published as policy@3" in refused["error"]
            assert trainer_holds(client) == {2, 3}
            trainer.send("send", step=1, seed=2)
            lower = trainer.recv(60)
            assert lower["type"] == "BadArgument" and "below step 2, already published as policy@3" in lower["error"]

            never = rollout.ask("receive", step=98, seed=99)
            assert never["type"] == "VersionTimeout", never
            assert "policy@99 did not become READY within 3s" in never["error"]
        finally:
            trainer.stop()
            rollout.stop()
            client.close()


def test_double_buffered_rollout_keeps_the_previous_step_published_for_joiners():
    pytest.importorskip("verl")
    with HubProcess(expiry_s=2.0) as hub:
        client = HubClient(hub.address, hub.token)
        # (all three start now, in parallel; each is awaited at its first question)
        trainer = driver("trainer", hub)
        rollout = driver("rollout", hub, "--double-buffer", "--name", "rollout-db")
        joiner = driver("rollout", hub, "--name", "joiner")
        try:
            # (step s is version s + 1)
            trainer.ask("send", step=0, seed=1)
            r1 = rollout.ask("receive", step=0, seed=1)
            trainer.ask("send", step=1, seed=2)
            r2 = rollout.ask("receive", step=1, seed=2)
            assert r1["equal"] and r2["equal"] and set(r1["ptrs"]).isdisjoint(r2["ptrs"])
            # Version 1 is still published by the rollout after it loaded version 2, so a
            # joiner reads it from the rollout, none of it from the trainer (which holds it
            # too: the hub retains the newest two versions, so version 3 makes it forget 1).
            assert holds(client, "rollout-db") == {1, 2}
            j1 = joiner.ask("receive", step=0, seed=1)
            assert j1["equal"] and j1["bytes"] > 0 and j1["from_publishers"] == 0, j1

            trainer.ask("send", step=2, seed=3)
            assert trainer_holds(client) == {2, 3}
            # Version 3 lands in version 1's set: two sets, never more, holding exactly {2, 3}.
            r3 = rollout.ask("receive", step=2, seed=3)
            assert r3["equal"] and r3["ptrs"] == r1["ptrs"]
            assert holds(client, "rollout-db") == {2, 3}
            # A version still held is yielded again from its own set, without a fetch.
            again = rollout.ask("receive", step=1, seed=2)
            assert again["equal"] and again["ptrs"] == r2["ptrs"] and again["bytes"] == 0
        finally:
            for d in (trainer, rollout, joiner):
                d.stop()
            client.close()


def test_a_run_from_step_0_keeps_every_tp_worker_of_a_replica_on_one_version():
    """A PPO run's syncs from its first (``global_steps=0``) on, for two rollout replicas
    of two TP workers each: one endpoint per worker, in its replica's group, which the
    adapter takes from ``$WG_PREFIX`` as verl sets it (``rollout_standalone_<replica>``).

    - verl's order (``CheckpointEngineManager.update_weights``): every worker asks for
      step s, then the trainer publishes it while they wait in their fetch; each gets
      version s + 1, bit exact.
    - ``latest`` (``global_steps=None``): the first worker of each replica fetches, the
      trainer publishes the next step, then the second worker fetches: both workers of a
      replica end on the same version, with its bytes, round after round."""
    pytest.importorskip("verl")
    seed = lambda step: 100 + step  # noqa: E731
    with HubProcess(expiry_s=5.0) as hub:
        trainer = driver("trainer", hub)
        workers = {(r, t): driver("rollout", hub, "--name", f"replica{r}-tp{t}", "--receive-timeout-s", "120",
                                  env={"WG_PREFIX": f"rollout_standalone_{r}"}) for r in (0, 1) for t in (0, 1)}
        try:
            for step in range(3):
                for w in workers.values():
                    w.send("receive", step=step, seed=seed(step))
                sent = trainer.ask("send", step=step, seed=seed(step), timeout=120)
                assert sent["metrics"]["checkpoint_engine/version"] == step + 1, sent
                got = {key: w.recv(120) for key, w in workers.items()}
                for key, reply in got.items():
                    assert reply.get("version") == step + 1 and reply["equal"], (step, key, reply)
                    assert reply["group"] == f"verl-nojob-rollout_standalone_{key[0]}", reply

            trainer.ask("send", step=3, seed=seed(3), timeout=120)
            for step in (3, 4, 5):  # latest is step's version, step + 1
                firsts = {r: workers[(r, 0)].ask("receive", step=None, seed=seed(step), timeout=120) for r in (0, 1)}
                trainer.ask("send", step=step + 1, seed=seed(step + 1), timeout=120)  # READY before the seconds ask
                seconds = {r: workers[(r, 1)].ask("receive", step=None, seed=seed(step), timeout=120) for r in (0, 1)}
                for r in (0, 1):
                    versions = [firsts[r].get("version"), seconds[r].get("version")]
                    assert versions == [step + 1] * 2, f"step {step}: replica {r}'s TP workers got {versions}"
                    assert firsts[r]["equal"] and seconds[r]["equal"], (step, r, firsts[r], seconds[r])
        finally:
            for d in (trainer, *workers.values()):
                d.stop()


def test_a_rollout_set_is_made_again_when_shapes_change_never_a_third():
    """In one process (both engines, no drivers): a step whose shapes changed drains the
    version in the set it replaces, so the rollout endpoint never holds three."""
    pytest.importorskip("verl")
    import torch

    from tensorhub_cli.adapters.verl import TensorHubCheckpointEngine

    def weights(step: int, rows: int) -> dict:
        return {"w": torch.full((rows, 64), float(step)), "b": torch.arange(7, dtype=torch.int32) + step}

    async def sync(trainer, rollout, step: int, rows: int) -> dict:
        await trainer.send_weights(iter(weights(step, rows).items()), global_steps=step)
        return {k: t.clone() async for k, t in rollout.receive_weights(global_steps=step)}

    with HubProcess(expiry_s=2.0) as hub:
        kw = dict(hub=hub.address, token_file=str(hub.token_file), engine="tcp", receive_timeout_s=30)
        trainer = TensorHubCheckpointEngine(bucket_size=1, is_master=True, **kw)
        rollout = TensorHubCheckpointEngine(bucket_size=1, double_buffer=True, **kw)
        try:
            for step, rows in [(0, 10), (1, 10), (2, 20), (3, 20)]:  # (step s is version s + 1)
                got = asyncio.run(sync(trainer, rollout, step, rows))
                assert all(torch.equal(got[k], t) for k, t in weights(step, rows).items()), step
                held = {h.version for h in rollout._ep[0].holdings()}
                assert held == ({step, step + 1} if step > 0 else {1}), (step, held)
                assert len(rollout._staging) == min(step + 1, 2)
            assert [s["w"].shape[0] for s in rollout._staging] == [20, 20]
        finally:
            rollout.close()
            trainer.close()


def test_other_trainer_ranks_consume_the_stream_and_publish_nothing(tmp_path):
    pytest.importorskip("verl")
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    import tensorhub_cli.adapters.verl  # noqa: F401 (registers "tensorhub")

    token = tmp_path / "token"
    token.write_text("t")
    engine = CheckpointEngineRegistry.new("tensorhub", is_master=False, bucket_size=1,
                                          hub="tcp://127.0.0.1:9", token_file=str(token))
    taken = []

    def weights():
        for i in range(3):
            taken.append(i)
            yield f"w{i}", None

    assert asyncio.run(engine.send_weights(weights(), global_steps=5)) == {}
    assert taken == [0, 1, 2] and engine._ep == []  # (never joined a hub: nothing to publish)
    assert engine.prepare() == {} and type(engine).build_topology(2, 4, [{}] * 6) == ({}, {})


def test_bad_engine_kwargs_name_the_field(tmp_path):
    pytest.importorskip("verl")
    from tensorhub_cli.adapters.verl import TensorHubCheckpointEngine
    from tensorhub_cli.errors import BadArgument

    token = tmp_path / "token"
    token.write_text("t")
    ok = dict(hub="tcp://127.0.0.1:9", token_file=str(token))
    for kwargs, field in [({}, "exactly one of cluster"), ({**ok, "cluster": "c"}, "exactly one of cluster"),
                          ({"hub": "tcp://h:1", "token_file": str(tmp_path / "none")}, ".token_file"),
                          ({**ok, "engine": "rdma"}, ".engine"), ({**ok, "model": "a b"}, ".model"),
                          ({**ok, "receive_timeout_s": 0}, ".receive_timeout_s"), ({**ok, "device": "tpu"}, ".device"),
                          ({**ok, "device": "meta"}, ".device"), ({**ok, "double_buffer": "yes"}, ".double_buffer"),
                          ({**ok, "double_buffer": 1}, ".double_buffer")]:
        with pytest.raises(BadArgument, match=field.replace(".", r"\.")):
            TensorHubCheckpointEngine(bucket_size=1, **kwargs)


def test_importing_without_verl_names_the_requirement():
    # sys.modules[...] = None makes `import verl` fail here whether verl is installed or not.
    code = "import sys; sys.modules['verl'] = None; import tensorhub_cli.adapters.verl"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "ImportError: tensorhub_cli.adapters.verl needs verl" in out.stderr
    assert "verl==0.9.1" in out.stderr and "requirements/verl.txt" in out.stderr
