"""A Llama's HF global tensors → vLLM's tensor-parallel parameters, as ``Target``s.

A hand-written engine layout for benches and tests that run without vLLM
(``th bench p2p``, the layout tests). The vLLM backend does not use it: it derives its
map from the loaded model itself, whatever the architecture (``vllm_map``).

Protocol. ``config``: a transformers ``LlamaConfig`` or anything with its fields
(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
num_hidden_layers, vocab_size, tie_word_embeddings; head_dim optional).

- ``global_shapes(config)`` → every HF parameter name (as ``LlamaForCausalLM`` names
  its parameters) and its global shape.
- ``params(config, rank, world, dtype, device)`` → fresh (uninitialised) vLLM-style
  parameters of TP rank ``rank`` of ``world``: ``qkv_proj`` (the rank's q rows, then
  its k rows, then its v rows), ``gate_up_proj`` (gate rows, then up rows); q/k/v,
  gate/up, embed_tokens and lm_head split by rows; o_proj and down_proj by columns;
  norms whole. Slices follow ``boxes.split`` (torch.chunk sizes). Real vLLM pads the
  vocabulary to a multiple of 64 per rank; this layout does not.
- ``targets(params, config, rank, world)`` → the ``Target`` for each of those params.
- ``reference(full_state_dict, config, rank, world)`` → what the params must equal,
  by plain slicing and ``torch.cat`` of the HF state dict (the tests' oracle; it does
  not use ``boxes``).

Refused with ``LayoutError``: fewer KV heads than ranks (vLLM then replicates KV heads:
not supported), heads or intermediate size not divisible by ``world`` (vLLM splits by
whole heads and asserts both), biases (attention_bias / mlp_bias).
"""

from __future__ import annotations

from ..errors import LayoutError
from .boxes import split
from .targets import Target, fused, tp, whole


def _dims(config, world: int, rank: int = 0) -> dict:
    problems = []
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "vocab_size", "tie_word_embeddings")
    for field in need:
        if not hasattr(config, field):
            problems.append(f"config.{field}: missing")
    if problems:
        raise LayoutError("config: not a Llama config", problems)
    heads, kv, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if not isinstance(world, int) or world < 1:
        problems.append(f"world: want a positive int, got {world!r}")
    elif not isinstance(rank, int) or not 0 <= rank < world:
        problems.append(f"rank: want an int in [0, {world}), got {rank!r}")
    else:
        if kv < world:
            problems.append(f"config.num_key_value_heads: {kv} KV heads over {world} ranks would replicate "
                            "KV heads, which is not supported")
        elif kv % world:
            problems.append(f"config.num_key_value_heads: {kv} is not divisible by world {world}")
        if heads % world:
            problems.append(f"config.num_attention_heads: {heads} is not divisible by world {world}")
        if config.intermediate_size % world:
            problems.append(f"config.intermediate_size: {config.intermediate_size} is not divisible by world {world}")
    for field in ("attention_bias", "mlp_bias"):
        if getattr(config, field, False):
            problems.append(f"config.{field}: biases are not supported")
    if problems:
        raise LayoutError("cannot lay out this Llama for vLLM TP", problems)
    return dict(H=hidden, I=config.intermediate_size, V=config.vocab_size, Q=heads * head_dim,
                KV=kv * head_dim, L=config.num_hidden_layers, tied=bool(config.tie_word_embeddings))


def global_shapes(config) -> dict[str, tuple]:
    d = _dims(config, 1)
    H, I = d["H"], d["I"]
    out = {"model.embed_tokens.weight": (d["V"], H)}
    for n in range(d["L"]):
        at = f"model.layers.{n}."
        out |= {at + "self_attn.q_proj.weight": (d["Q"], H), at + "self_attn.k_proj.weight": (d["KV"], H),
                at + "self_attn.v_proj.weight": (d["KV"], H), at + "self_attn.o_proj.weight": (H, d["Q"]),
                at + "mlp.gate_proj.weight": (I, H), at + "mlp.up_proj.weight": (I, H),
                at + "mlp.down_proj.weight": (H, I),
                at + "input_layernorm.weight": (H,), at + "post_attention_layernorm.weight": (H,)}
    out["model.norm.weight"] = (H,)
    if not d["tied"]:
        out["lm_head.weight"] = (d["V"], H)
    return out


def _plan(config, rank: int, world: int) -> dict:
    """vLLM name → (how, HF names): ``("fused", [names])`` split by rows and stacked,
    ``("tp", name, dim)``, ``("whole", name)``."""
    _dims(config, world, rank)
    plan = {}
    for name in global_shapes(config):
        if ".self_attn.q_proj." in name:
            plan[name.replace("q_proj", "qkv_proj")] = ("fused", [name.replace("q_proj", x) for x in ("q_proj", "k_proj", "v_proj")])
        elif ".mlp.gate_proj." in name:
            plan[name.replace("gate_proj", "gate_up_proj")] = ("fused", [name.replace("gate_proj", x) for x in ("gate_proj", "up_proj")])
        elif any(f".{x}." in name for x in ("k_proj", "v_proj", "up_proj")):
            continue  # fused above
        elif ".o_proj." in name or ".down_proj." in name:
            plan[name] = ("tp", name, 1)
        elif name.endswith("norm.weight"):
            plan[name] = ("whole", name)
        else:  # embed_tokens, lm_head
            plan[name] = ("tp", name, 0)
    return plan


def _local_shape(gshape: tuple, dim: int, rank: int, world: int) -> tuple:
    return gshape[:dim] + (split(gshape[dim], world, rank)[1],) + gshape[dim + 1:]


def params(config, rank: int, world: int, dtype, device="cpu") -> dict:
    import torch

    shapes = global_shapes(config)
    out = {}
    for vname, how in _plan(config, rank, world).items():
        if how[0] == "fused":
            locals_ = [_local_shape(shapes[n], 0, rank, world) for n in how[1]]
            shape = (sum(s[0] for s in locals_),) + locals_[0][1:]
        elif how[0] == "tp":
            shape = _local_shape(shapes[how[1]], how[2], rank, world)
        else:
            shape = shapes[how[1]]
        out[vname] = torch.empty(shape, dtype=dtype, device=device)
    return out


def targets(params: dict, config, rank: int, world: int) -> dict[str, Target]:
    shapes = global_shapes(config)
    plan = _plan(config, rank, world)
    problems = [f"{n}: missing from params" for n in plan if n not in params]
    problems += [f"{n}: not a parameter of this layout" for n in params if n not in plan]
    if problems:
        raise LayoutError("params do not match the vLLM Llama layout", problems)
    out = {}
    for vname, how in plan.items():
        t = params[vname]
        if how[0] == "fused":
            out[vname] = fused(t, [(n, shapes[n]) for n in how[1]], 0, rank, world)
        elif how[0] == "tp":
            out[vname] = tp(how[1], t, shapes[how[1]], how[2], rank, world)
        else:
            if tuple(t.shape) != shapes[how[1]]:
                raise LayoutError(f"{vname}: wrong shape", [f"{vname}: shape {list(t.shape)}, want {list(shapes[how[1]])}"])
            out[vname] = whole(how[1], t)
    return out


def _chunk(t, dim: int, rank: int, world: int):
    """Rank's torch.chunk piece (an empty one where torch.chunk returns fewer)."""
    pieces = t.chunk(world, dim)
    return pieces[rank] if rank < len(pieces) else t.narrow(dim, t.shape[dim], 0)


def reference(full_state_dict: dict, config, rank: int, world: int) -> dict:
    # Spelled out from the HF names, not from ``_plan``: an oracle sharing the plan
    # would share its mistakes (a fusion order, a split dim).
    import torch

    d = _dims(config, world, rank)
    sd = full_state_dict

    def rows(n):
        return _chunk(sd[n], 0, rank, world).contiguous()

    def cols(n):
        return _chunk(sd[n], 1, rank, world).contiguous()

    out = {"model.embed_tokens.weight": rows("model.embed_tokens.weight")}
    for n in range(d["L"]):
        at = f"model.layers.{n}."
        out[at + "self_attn.qkv_proj.weight"] = torch.cat([rows(at + f"self_attn.{x}_proj.weight") for x in "qkv"])
        out[at + "self_attn.o_proj.weight"] = cols(at + "self_attn.o_proj.weight")
        out[at + "mlp.gate_up_proj.weight"] = torch.cat([rows(at + "mlp.gate_proj.weight"), rows(at + "mlp.up_proj.weight")])
        out[at + "mlp.down_proj.weight"] = cols(at + "mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[at + f"{norm}.weight"] = sd[at + f"{norm}.weight"].clone()
    out["model.norm.weight"] = sd["model.norm.weight"].clone()
    if not d["tied"]:
        out["lm_head.weight"] = rows("lm_head.weight")
    return out
