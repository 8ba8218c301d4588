"""What a delta trace records per tensor: its class, by the Hugging Face Llama name.

Protocol. ``tensor_class(name)`` is one of ``CLASSES`` (attention, mlp, norm, embed;
``lm_head`` counts as embed), or raises ``ValueError`` naming the tensor. Shared by
scripts/delta_trace.py (which writes a trace) and `th bench delta` (which replays its
changed shares per class).
"""

from __future__ import annotations

CLASSES = ("attention", "mlp", "norm", "embed")


def tensor_class(name: str) -> str:
    if "self_attn" in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:
        return "norm"
    if "embed" in name or "lm_head" in name:
        return "embed"
    raise ValueError(f"tensor {name!r}: no class (attention, mlp, norm, embed) matches its name")
