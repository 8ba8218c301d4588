"""Target helpers (whole, tp, fused, targets) and the vLLM Llama TP layout, on CPU.

Each slot's view must be where its box says: values written through the slot views
from the global tensors must rebuild the target tensor that plain slicing and
``torch.cat`` of those global tensors give."""

from __future__ import annotations

import pytest
import torch

from tensorhub_cli.errors import LayoutError
from tensorhub_cli.layout import vllm_llama
from tensorhub_cli.layout.boxes import Box, cover_problems
from tensorhub_cli.endpoint.layouts import targets
from tensorhub_cli.layout.targets import Part, Slot, Target, fused, tp, whole


def region(t, box: Box):
    return t[tuple(slice(o, e) for o, e in zip(box.offsets, box.ends))]


def fill(target: Target, globals_: dict) -> None:
    """Copy each slot's box of its global tensor into the slot's view."""
    for s in target.slots:
        assert tuple(s.view.shape) == s.box.sizes
        assert s.view.untyped_storage().data_ptr() == target.tensor.untyped_storage().data_ptr()
        s.view.copy_(region(globals_[s.name], s.box))


def g(*shape):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_whole_is_one_slot_over_the_tensor():
    t = torch.zeros(3, 4)
    tg = whole("w", t)
    assert [(s.name, s.box, s.global_shape) for s in tg.slots] == [("w", Box((0, 0), (3, 4)), (3, 4))]
    fill(tg, {"w": g(3, 4)})
    assert torch.equal(t, g(3, 4))


@pytest.mark.parametrize("dim,world", [(0, 2), (1, 2), (0, 3), (1, 4)])
def test_tp_slot_is_the_ranks_chunk(dim, world):
    full = g(6, 8)
    for rank in range(world):
        want = full.chunk(world, dim)[rank]
        t = torch.full(want.shape, float("nan"))
        tg = tp("w", t, full.shape, dim, rank, world)
        fill(tg, {"w": full})
        assert torch.equal(t, want)


def test_tp_uneven_last_rank_empty_has_no_slot():
    # 5 rows over 4 ranks: torch.chunk gives 2, 2, 1, then nothing.
    full = g(5, 2)
    sizes = []
    for rank in range(4):
        rows = full.chunk(4, 0)[rank].shape[0] if rank < len(full.chunk(4, 0)) else 0
        t = torch.empty(rows, 2)
        tg = tp("w", t, (5, 2), 0, rank, 4)
        fill(tg, {"w": full})
        sizes.append(rows)
        assert len(tg.slots) == (1 if rows else 0)
    assert sizes == [2, 2, 1, 0]


def test_tp_wrong_shape_names_the_tensor():
    with pytest.raises(LayoutError, match=r"attn\.w.*\[3, 8\].*want \[2, 8\]"):
        tp("attn.w", torch.empty(3, 8), (6, 8), 0, 0, 3)
    with pytest.raises(LayoutError, match="rank"):
        tp("w", torch.empty(3, 8), (6, 8), 0, 2, 2)
    with pytest.raises(LayoutError, match="dim"):
        tp("w", torch.empty(3, 8), (6, 8), 2, 0, 2)
    with pytest.raises(LayoutError, match="w: not contiguous"):
        tp("w", torch.empty(8, 3).t(), (6, 8), 0, 0, 2)


@pytest.mark.parametrize("dim", [0, 1])
def test_fused_slots_follow_each_other(dim):
    q, k, v = g(8, 4), g(4, 4) + 100, g(4, 4) + 200
    if dim == 1:
        q, k, v = q.t().contiguous(), k.t().contiguous(), v.t().contiguous()
    globals_ = {"q": q, "k": k, "v": v}
    for world in (1, 2, 4):
        for rank in range(world):
            want = torch.cat([t.chunk(world, dim)[rank] for t in (q, k, v)], dim)
            t = torch.full(want.shape, float("nan"))
            tg = fused(t, [(n, x.shape) for n, x in globals_.items()], dim, rank, world)
            assert [s.name for s in tg.slots] == ["q", "k", "v"]
            fill(tg, globals_)
            assert torch.equal(t, want)


def test_fused_bad_sizes_name_the_parts():
    parts = [("q", (8, 4)), ("k", (4, 4))]
    with pytest.raises(LayoutError, match=r"q, k.*add up to 6.*has 7"):
        fused(torch.empty(7, 4), parts, 0, 0, 2)
    with pytest.raises(LayoutError, match=r"k: dim 1 is 4 globally but 5"):
        fused(torch.empty(6, 5), [("q", (8, 5)), ("k", (4, 4))], 0, 0, 2)


def test_targets_normalises_a_destination():
    a, b = torch.zeros(2, 3), torch.zeros(4)
    own = tp("c", torch.zeros(1, 3), (2, 3), 0, 1, 2)
    out = targets({"a": a, "b": b, "own": own})
    assert out[2] is own
    assert [(x.tensor is t, x.slots[0].name, x.slots[0].box) for x, t in zip(out[:2], (a, b))] == [
        (True, "a", Box((0, 0), (2, 3))), (True, "b", Box((0,), (4,)))]
    with pytest.raises(LayoutError, match=r"bad: a list.*\n.*nc: not contiguous") as e:
        targets({"bad": [1], "ok": a, "nc": torch.zeros(3, 2).t()})
    assert len(e.value.problems) == 2


def test_records_still_build():
    # The records are fixed; the helpers must not have changed them.
    p = Part(torch.zeros(2, 3), (4, 3), (2, 0))
    assert p.box == Box((2, 0), (2, 3))
    assert Slot("x", Box((0,), (1,)), None).global_shape is None


# ---- vLLM Llama

def tiny(**kw):
    from transformers import LlamaConfig

    base = dict(hidden_size=32, intermediate_size=24, num_attention_heads=8, num_key_value_heads=4,
                num_hidden_layers=2, vocab_size=64, tie_word_embeddings=False, head_dim=4)
    return LlamaConfig(**(base | kw))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def llama(request):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny(tie_word_embeddings=request.param)
    model = LlamaForCausalLM(config)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    return config, full


def test_global_shapes_are_the_models(llama):
    config, full = llama
    assert vllm_llama.global_shapes(config) == {n: tuple(t.shape) for n, t in full.items()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vllm_targets_rebuild_the_reference(llama, world):
    config, full = llama
    boxes: dict[str, list[Box]] = {}
    for rank in range(world):
        params = vllm_llama.params(config, rank, world, torch.float32)
        for t in params.values():
            t.fill_(float("nan"))  # any element no slot writes stays NaN: not equal
        tgs = vllm_llama.targets(params, config, rank, world)
        assert tgs.keys() == params.keys()
        for name, tg in tgs.items():
            assert tg.tensor is params[name]
            fill(tg, full)
            for s in tg.slots:
                assert s.global_shape == tuple(full[s.name].shape)
                boxes.setdefault(s.name, []).append(s.box)
        ref = vllm_llama.reference(full, config, rank, world)
        assert ref.keys() == params.keys()
        for name in ref:
            assert ref[name].shape == params[name].shape, name
            assert torch.equal(ref[name], params[name]), name
    # Over the ranks, each TP-split tensor is covered exactly once; norms once per rank.
    for name, bs in boxes.items():
        if name.endswith("norm.weight"):
            assert bs == [Box.whole(full[name].shape)] * world
        else:
            assert cover_problems(name, full[name].shape, bs) == [], name


def test_vllm_names():
    params = vllm_llama.params(tiny(num_hidden_layers=1), 0, 2, torch.bfloat16)
    assert sorted(params) == sorted([
        "model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight"])
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shape == (16 + 8 + 8, 32)
    assert params["model.layers.0.mlp.gate_up_proj.weight"].shape == (24, 32)
    assert params["model.layers.0.self_attn.o_proj.weight"].shape == (32, 16)
    assert params["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16


def test_vllm_refuses_what_it_cannot_lay_out():
    with pytest.raises(LayoutError, match="num_key_value_heads.*replicate KV heads.*not supported"):
        vllm_llama.params(tiny(num_key_value_heads=2), 0, 4, torch.float32)
    with pytest.raises(LayoutError, match="num_attention_heads: 8 is not divisible by world 3"):
        vllm_llama.params(tiny(num_key_value_heads=6, num_attention_heads=8), 0, 3, torch.float32)
    config = tiny()
    params = vllm_llama.params(config, 0, 2, torch.float32)
    params.pop("model.norm.weight")
    with pytest.raises(LayoutError, match="model.norm.weight: missing"):
        vllm_llama.targets(params, config, 0, 2)
    params = vllm_llama.params(config, 0, 2, torch.float32)
    params["model.layers.1.self_attn.o_proj.weight"] = torch.empty(32, 32)
    with pytest.raises(LayoutError, match=r"model.layers.1.self_attn.o_proj.weight.*\[32, 32\].*want \[32, 16\]"):
        vllm_llama.targets(params, config, 0, 2)
