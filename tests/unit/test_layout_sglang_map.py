"""``layout.sglang_map`` against a STAND-IN for SGLang's Llama (``sglang_standin``: SGLang
cannot be installed here; the stand-in keeps the loader interfaces SGLang 0.5.23
implements): the map derived from a TP rank's model names exactly the boxes its own
loaders take, a shadow filled from those boxes and applied equals what the model's own
``load_weights`` makes of the whole tensors, and what it cannot map is refused."""

from __future__ import annotations

import pytest
import torch
from types import SimpleNamespace

from tensorhub_cli.layout.engine_map import Unmapped
from tensorhub_cli.layout.sglang_map import apply, derive

from . import sglang_standin as sgl

CONFIG = dict(vocab_size=253, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=False)


def tensors_of(weights: dict) -> dict:
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights.items()}


def filled(emap, weights: dict) -> dict:
    """What a fetch into ``emap.targets`` leaves in a shadow: each slot's box."""
    shadow = emap.allocate("cpu")
    for target in emap.targets(shadow).values():
        for s in target.slots:
            s.view.copy_(weights[s.name][tuple(slice(o, o + n) for o, n in zip(s.box.offsets, s.box.sizes))])
    return shadow


@pytest.mark.parametrize("world, tied", [(1, False), (2, False), (2, True), (4, False)])
def test_a_tp_ranks_shard_applied_equals_its_own_load_weights_of_the_whole_tensors(world, tied):
    cfg = SimpleNamespace(**{**CONFIG, "tie_word_embeddings": tied})
    weights = sgl.hf_weights(vars(cfg), seed=1)
    for rank in range(world):
        oracle = sgl.LlamaForCausalLM(cfg, rank, world)
        oracle.load_weights(weights.items())  # (SGLang's own route: whole tensors through its loaders)
        model = sgl.LlamaForCausalLM(cfg, rank, world)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        emap = derive(model, tensors_of(weights))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # (recording wrote nothing)
        assert model.model.layers[0].self_attn.qkv_proj.weight.weight_loader.__func__ is \
            sgl.QKVParallelLinear.weight_loader and not hasattr(model.model.norm.weight, "weight_loader")
        assert set(emap.classes.values()) == {"copy"}
        apply(model, emap, filled(emap, weights))
        got, want = model.state_dict(), oracle.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
        share = sum(s.view.nbytes for t in emap.targets(emap.allocate("cpu")).values() for s in t.slots)
        assert emap.shard_bytes == share
        if world > 1:  # a shard, not the model: fused q/k/v, gate/up and the vocabulary split
            assert emap.shard_bytes < sum(t.nbytes for t in weights.values()) * 0.75, emap.shard_bytes
        if tied:
            assert "lm_head.weight" in emap.ignored


def test_a_loader_that_transposes_and_a_load_weights_that_bypasses_loaders_are_refused():
    cfg = SimpleNamespace(**CONFIG)
    weights = sgl.hf_weights(CONFIG, seed=1)
    model = sgl.LlamaForCausalLM(cfg, 0, 2)
    for layer in model.model.layers:  # (replays are cached per layer class and shape: every one alike)
        layer.mlp.down_proj.weight.weight_loader = lambda p, w: p.data.copy_(w.narrow(1, 0, p.shape[1]).flip(0))
    with pytest.raises(Unmapped, match="RowParallelLinear.weight"):
        derive(model, tensors_of(weights))

    class Bypass(sgl.LlamaForCausalLM):  # copies by name, no weight_loader (a model SGLang would not ship)
        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, t in weights:
                if name in params and params[name].shape == t.shape:
                    params[name].data.copy_(t)

    with pytest.raises(Unmapped, match="failed over stand-ins|loads nothing"):
        derive(Bypass(cfg, 0, 1), tensors_of(weights))


def test_a_shadow_that_does_not_fit_changes_nothing():
    cfg = SimpleNamespace(**CONFIG)
    weights = sgl.hf_weights(CONFIG, seed=1)
    model = sgl.LlamaForCausalLM(cfg, 0, 2)
    emap = derive(model, tensors_of(weights))
    shadow = filled(emap, weights)
    key = next(k for k in shadow if k.endswith("down_proj:weight"))
    shadow[key] = torch.zeros(3, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="nothing was copied"):
        apply(model, emap, shadow)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
