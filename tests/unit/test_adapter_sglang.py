"""The SGLang custom weight loader, called as SGLang's ``WeightUpdater`` calls it
(``load(model, named_tensors)``), against a real hub process. SGLang itself is not
installed here (CPU machines); the model is a transformers Llama behind the contract
SGLang's models keep: ``load_weights(iterable of (hf_name, tensor))``."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tensorhub_cli import connect
from tensorhub_cli.adapters import hf, sglang
from tensorhub_cli.errors import BadArgument
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from ..integration.test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration  # (a real hub process)


class SGLangStyle(torch.nn.Module):
    """A model whose ``load_weights`` copies each HF-named tensor into its parameter,
    recording the names it was given (as SGLang's ``LlamaForCausalLM.load_weights``)."""

    def __init__(self, seed: int):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.inner = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        self.loaded: list[list[str]] = []

    def load_weights(self, weights):
        params = hf.destination(self.inner)
        names = []
        for name, tensor in weights:
            params[name].copy_(tensor)
            names.append(name)
        self.loaded.append(names)


@pytest.fixture
def env(token_file, monkeypatch):  # noqa: F811
    """A hub, a trainer endpoint publishing on it, and the loader's environment."""
    address = f"tcp://127.0.0.1:{free_port()}"
    # The loader's endpoint beats at connect's default 1 s: an expiry above that, so a
    # busy machine does not make the hub forget the holder a reader is sent to.
    proc, client = start_hub(token_file, address, expiry_s=5.0)
    for key, value in dict(TH_HUB=address, TH_TOKEN_FILE=str(token_file), TH_MODEL="policy", TH_ENGINE="tcp",
                           TH_NAME="sglang-0", TH_FETCH_TIMEOUT_S="30").items():
        monkeypatch.setenv(key, value)
    for key in ("TH_CLUSTER", "TH_TOKEN", "TH_VERSION", "TH_GROUP"):
        monkeypatch.delenv(key, raising=False)
    trainer = connect(hub=address, token=TOKEN, name="trainer", engine="tcp", heartbeat_s=0.2)
    yield trainer
    sglang.close(drain_timeout=0)
    trainer.close(drain_timeout=0)
    client.close()
    stop_child(proc)


def weights_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_fetches_the_named_version_and_hands_it_to_load_weights_by_hf_names(env, monkeypatch):
    v1, v2 = SGLangStyle(1).inner, SGLangStyle(2).inner
    hf.publish(env, "policy", 1, v1)
    model = SGLangStyle(3)
    assert sglang.load(model, []) == 1  # TH_VERSION unset: latest
    assert weights_equal(model.inner, v1)
    assert sorted(model.loaded[-1]) == sorted(hf.destination(v1))
    staging = {k: t.data_ptr() for k, t in sglang._state["staging"].items()}

    hf.publish(env, "policy", 2, v2)
    monkeypatch.setenv("TH_VERSION", "1")
    assert sglang.load(model, [(sglang.VERSION_KEY, torch.tensor(2))]) == 2  # the update's own version wins
    assert weights_equal(model.inner, v2)
    assert sglang.load(model, None) == 1  # back to TH_VERSION, into the same staging memory
    assert weights_equal(model.inner, v1) and len(model.loaded) == 3
    assert {k: t.data_ptr() for k, t in sglang._state["staging"].items()} == staging


@pytest.mark.parametrize("named, unset, needle", [
    ([("model.norm.weight", torch.ones(32))], None, "named_tensors: 'model.norm.weight' is not 'tensorhub.version'"),
    ([(sglang.VERSION_KEY, torch.tensor(1.5))], None, "must be one integer"),
    ([], "TH_MODEL", "TH_MODEL is not set"),
    ([], "TH_HUB", "TH_HUB is not set"),
])
def test_bad_input_is_refused_by_name_before_anything_is_loaded(env, monkeypatch, named, unset, needle):
    hf.publish(env, "policy", 1, SGLangStyle(1).inner)
    if unset:
        monkeypatch.delenv(unset)
    model = SGLangStyle(3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(BadArgument, match=needle):
        sglang.load(model, named)
    assert model.loaded == [] and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_bad_th_version_is_named(env, monkeypatch):
    monkeypatch.setenv("TH_VERSION", "newest")
    with pytest.raises(BadArgument, match="TH_VERSION must be a number or 'latest', not 'newest'"):
        sglang.load(SGLangStyle(3), [])


def _mine(trainer) -> dict[int, bool]:
    """{version: complete} of the loader's replicas as the hub lists them (not draining)."""
    return {v.version: h.complete for v in trainer.versions("policy") for h in v.holders
            if h.name.startswith("sglang-0-") and not h.draining}


def test_double_buffered_staging_keeps_the_previous_version_published_until_a_newer_needs_its_set(
        env, monkeypatch):
    """TH_DOUBLE_BUFFER=1: loading v2 leaves v1 published in the other set (a reader gets
    v1 from the loader after the trainer let it go); v3 then takes v1's set, so two sets
    of memory, never three versions. With one set, loading v2 unpublishes v1 first."""
    monkeypatch.setenv("TH_DOUBLE_BUFFER", "1")
    versions = {v: SGLangStyle(v).inner for v in (1, 2, 3)}
    model = SGLangStyle(9)
    hf.publish(env, "policy", 1, versions[1])
    assert sglang.load(model, []) == 1
    first = {k: t.data_ptr() for k, t in sglang._state["staging"].items()}
    hf.publish(env, "policy", 2, versions[2])
    assert sglang.load(model, []) == 2 and weights_equal(model.inner, versions[2])
    assert _mine(env) == {1: True, 2: True}

    env.unpublish("policy", 1)  # the loader is now v1's only holder
    into = {k: torch.empty_like(t) for k, t in hf.destination(versions[1]).items()}
    with connect(hub=os.environ["TH_HUB"], token=TOKEN, name="reader", engine="tcp", heartbeat_s=0.2) as reader:
        assert reader.fetch("policy", 1, into=into, timeout=30) == 1
        assert reader.last_fetch["bytes"] > 0 and reader.last_fetch["from_publishers"] == 0
    assert all(torch.equal(into[k], t) for k, t in hf.destination(versions[1]).items())

    hf.publish(env, "policy", 3, versions[3])
    assert sglang.load(model, []) == 3 and weights_equal(model.inner, versions[3])
    assert _mine(env) == {2: True, 3: True}
    assert {k: t.data_ptr() for k, t in sglang._state["staging"].items()} == first  # v1's set again
    assert len(sglang._state["sets"]) == 2


def test_one_staging_set_by_default_unpublishes_the_previous_version_before_the_next(env):
    hf.publish(env, "policy", 1, SGLangStyle(1).inner)
    model = SGLangStyle(9)
    assert sglang.load(model, []) == 1
    hf.publish(env, "policy", 2, SGLangStyle(2).inner)
    assert sglang.load(model, []) == 2
    assert _mine(env) == {2: True} and len(sglang._state["sets"]) == 1


def test_a_bad_th_double_buffer_is_named(env, monkeypatch):
    monkeypatch.setenv("TH_DOUBLE_BUFFER", "two")
    with pytest.raises(BadArgument, match="TH_DOUBLE_BUFFER must be 1 or 0, not 'two'"):
        sglang.load(SGLangStyle(3), [])


RANK = """
import json, sys
from tensorhub_cli.adapters import sglang
from tests.unit.test_adapter_sglang import SGLangStyle, weights_equal
model = SGLangStyle(9)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "exit":
        break
    got = sglang.load(model, [])
    print(json.dumps({"version": got, "group": sglang._state["ep"].info.group,
                      "equal": weights_equal(model.inner, SGLangStyle(cmd["seed"]).inner)}), flush=True)
sglang.close(drain_timeout=0)
"""


def test_the_tp_ranks_of_one_server_load_one_version_of_latest_by_default(env):
    """Two TP ranks as SGLang runs them: sibling processes (children of the server's
    process) with the server's environment, no TH_GROUP. Rank 0 loads ``latest`` (v1),
    v2 turns READY, rank 1 loads ``latest``: v1 as well (their default group), then the
    next update moves both to v2."""
    from tensorhub_cli.bench.rig import Driven

    from ..conftest import REPO

    hf.publish(env, "policy", 1, SGLangStyle(1).inner)
    ranks = [Driven(f"sglang-tp{r}", ["-c", RANK], cwd=str(REPO), env={"TH_NAME": f"sglang-tp{r}"}) for r in (0, 1)]
    try:
        first = ranks[0].ask("load", seed=1, timeout=120)
        hf.publish(env, "policy", 2, SGLangStyle(2).inner)
        second = ranks[1].ask("load", seed=1, timeout=120)
        assert [first["version"], second["version"]] == [1, 1], (first, second)
        assert first["equal"] and second["equal"]
        assert first["group"] == second["group"] == f"sglang-{socket.gethostname()}-{os.getpid()}"
        again = [r.ask("load", seed=2, timeout=120) for r in ranks]
        assert [a["version"] for a in again] == [2, 2] and all(a["equal"] for a in again), again
    finally:
        for r in ranks:
            r.stop()
