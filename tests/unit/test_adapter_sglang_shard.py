"""The SGLang loader's shard path (``adapters.sglang`` + ``layout.sglang_map``) against a
real hub, with a STAND-IN for SGLang's model (``sglang_standin``: SGLang cannot be
installed here; the stand-in keeps the loader interfaces SGLang 0.5.23 implements) and
a stand-in for SGLang's TP group coordinator (its ``broadcast_object``): two TP ranks,
each its own process as SGLang runs them, read only their shard of a version the
trainer published with the default chunking, and hold what their own loaders make of
the whole tensors. A model the map cannot cover takes the whole path, said."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tensorhub_cli.adapters import sglang

from ..integration.test_hub_service import token_file  # noqa: F401 (a fixture)
from . import sglang_standin as sgl
from .test_adapter_sglang import SGLangStyle, env  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration  # (a real hub process)

CONFIG = dict(vocab_size=253, hidden_size=512, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)

RANK = """
import json, sys
from types import SimpleNamespace
import torch
from tensorhub_cli.adapters import sglang
from tests.unit import sglang_standin as sgl
config, rank = json.loads(sys.argv[1]), int(sys.argv[2])
model = sgl.LlamaForCausalLM(SimpleNamespace(**config), rank, 2)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "exit":
        break
    got = sglang.load(model, [(sglang.VERSION_KEY, torch.tensor(cmd["version"]))])
    oracle = sgl.LlamaForCausalLM(SimpleNamespace(**config), rank, 2)
    oracle.load_weights(sgl.hf_weights(config, cmd["seed"]).items())
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), oracle.state_dict().values()))
    print(json.dumps({"version": got, "equal": equal, **sglang.last()}), flush=True)
sglang.close(drain_timeout=0)
"""


def test_two_tp_ranks_read_their_shards_and_hold_what_their_loaders_make_of_the_whole_version(env):  # noqa: F811
    from tensorhub_cli.bench.rig import Driven

    from ..conftest import REPO

    total = 0
    for v in (1, 2):
        weights = sgl.hf_weights(CONFIG, seed=v)
        total = sum(t.nbytes for t in weights.values())
        env.publish("policy", v, weights)  # (the default chunking, as a trainer publishes)
    ranks = [Driven(f"sglang-tp{r}", ["-c", RANK, json.dumps(CONFIG), str(r)], cwd=str(REPO),
                    env={"TH_NAME": f"sglang-tp{r}"}) for r in (0, 1)]
    try:
        for v in (1, 2):
            got = [r.ask("load", version=v, seed=v, timeout=120) for r in ranks]
            for g in got:
                assert g["version"] == v and g["path"] == "shard" and g["equal"], g
                assert g["shard_bytes"] < total * 0.6, (g, total)  # a shard: half the model and its norms
                assert 0 < g["bytes"] <= g["shard_bytes"] * 1.05, g
        again = [r.ask("load", version=2, seed=2, timeout=120) for r in ranks]  # (the version it holds)
        assert all(g["version"] == 2 and g["equal"] for g in again), again
    finally:
        for r in ranks:
            r.stop()


def test_a_model_whose_load_weights_bypasses_its_loaders_takes_the_whole_path_and_says_why(env, caplog):  # noqa: F811
    from tensorhub_cli.adapters import hf

    v1 = SGLangStyle(1).inner
    hf.publish(env, "policy", 1, v1)
    model = SGLangStyle(3)
    with caplog.at_level("WARNING", logger="tensorhub_cli.adapters.sglang"):
        assert sglang.load(model, []) == 1
    assert sglang.last()["path"] == "whole" and "load_weights" in sglang.last()["reason"]
    assert sum("falls back to whole tensors" in r.getMessage() for r in caplog.records) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.inner.state_dict().values(), v1.state_dict().values()))


class Group:
    """A STAND-IN for SGLang's ``GroupCoordinator`` (``rank_in_group``, ``world_size``,
    ``broadcast_object(obj, src=0)``): rank 0's object, handed to the others in order."""

    def __init__(self, rank: int, box: list):
        self.rank_in_group, self.world_size, self.box = rank, 2, box

    def broadcast_object(self, obj=None, src: int = 0):
        if self.rank_in_group == src:
            self.box.append(obj)
            return obj
        return self.box[-1]


def test_rank_0_resolves_for_every_rank_of_the_tp_group_and_they_share_its_resolution():
    asked = []

    class Hub:
        name = "rank"

        def versions(self, model):
            asked.append(("versions", model))
            return [SimpleNamespace(version=v, state=s) for v, s in ((1, "READY"), (2, "READY"), (3, "STAGING"))]

        def resolve(self, model, version, wait=True):
            asked.append(("resolve", model, version, wait))
            return SimpleNamespace(model=model, version=version)

    box: list = []
    got = [sglang._agree(Hub(), "policy", "latest", Group(r, box)) for r in (0, 1)]
    assert got[0] is got[1] and got[0].version == 2  # one resolution, rank 0's
    assert asked == [("versions", "policy"), ("resolve", "policy", 2, False)]  # rank 0 alone asks the hub
    got = [sglang._agree(Hub(), "policy", 7, Group(r, box)) for r in (0, 1)]
    assert got[0] is got[1] and got[0].version == 7  # a number too: resolved once
    assert asked[-1] == ("resolve", "policy", 7, False) and len(asked) == 3
    assert sglang._agree(Hub(), "policy", "latest", None) == "latest"  # (outside SGLang: the endpoint's group)


def test_with_no_version_to_resolve_every_rank_keeps_asking_on_its_own():
    class Hub:
        name = "rank"

        def versions(self, model):
            return [SimpleNamespace(version=1, state="STAGING")]

        def resolve(self, model, version, wait=True):
            raise AssertionError("nothing READY: nothing to resolve")

    box: list = []
    assert [sglang._agree(Hub(), "policy", "latest", Group(r, box)) for r in (0, 1)] == ["latest", "latest"]