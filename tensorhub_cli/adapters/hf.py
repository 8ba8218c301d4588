"""Hugging Face ``transformers`` models ⇄ TensorHub versions, by their HF names.

Protocol.

- ``publish(ep, model_name, version, model_or_state_dict)``: publishes the model's
  ``state_dict()`` (or the dict given) under its HF names, the names ``save_pretrained``
  writes and ``from_pretrained`` reads. Contiguous tensors are published in place (the
  model's own memory: contract 3, it must not change until unpublished); a
  non-contiguous one is copied to a contiguous tensor once, and that copy is what is
  published. **Tied weights**: entries that are one tensor (same memory, dtype, shape
  and strides; e.g. Llama's ``lm_head.weight`` tied to ``model.embed_tokens.weight``)
  are published once, under the name ``save_pretrained`` keeps and the loader expects
  in a checkpoint: the *source* of ``model.all_tied_weights_keys`` (``target → source``
  in transformers 5; ``model.embed_tokens.weight``), never a tied target; for a plain
  dict, the first name in its order. Entries that overlap without being one tensor
  are a ``LayoutError`` naming both: their bytes would be published twice.
- ``fetch(ep, model_name, version, hf_model)``: fetches into the model's own
  parameters and persistent buffers, in place (the destination is ``state_dict()``,
  tied weights once, as above) and returns the version. A tensor whose shape, dtype or
  contiguity differs from the version's, or a name one side lacks, is a
  ``LayoutError`` naming each tensor, raised before anything is written.
- ``fetch_state_dict(ep, model_name, version)``: ``(version, state_dict)`` in fresh
  tensors, one per global tensor of the version (a sharded publisher's pieces land in
  place in one tensor), on ``device``.
- ``read_dir(path)``: an HF checkpoint directory as ``{name: tensor}``: the shards
  ``model.safetensors.index.json``'s ``weight_map`` names, or else one
  ``model.safetensors``. ``check_dir(path)`` validates it without reading weights
  (index, every shard file present and a safetensors file holding what the index
  says). Tensors are safetensors' memory maps of the files (copy-on-write: nothing is
  read until used). A bad directory is a ``CheckpointError`` naming the path, the shard
  file or the tensor at fault.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..errors import BadArgument, EndpointError, LayoutError, TensorHubError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(TensorHubError, ValueError):
    """An HF checkpoint directory that cannot be read; the message names what is wrong."""


def _state_dict(source) -> tuple[dict, dict]:
    """``(state_dict, tied)``: ``tied`` maps a tied target name to its source."""
    if isinstance(source, dict):
        return source, {}
    if not hasattr(source, "state_dict"):
        raise BadArgument(f"hf_model: a transformers model (nn.Module) or a state dict, not {type(source).__name__}")
    tied = getattr(source, "all_tied_weights_keys", None) or getattr(source, "_tied_weights_keys", None) or {}
    return source.state_dict(), dict(tied) if isinstance(tied, dict) else {}


def distinct(state_dict: dict, tied: Optional[dict] = None) -> dict:
    """``state_dict`` with each tensor once (see the module docstring: which name stays)."""
    import torch

    tied = tied or {}
    kept: dict[tuple, str] = {}
    spans: list[tuple[str, int, int, tuple]] = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise LayoutError("the state dict holds a non-tensor", [f"{name}: {type(t).__name__}"])
        if not t.numel():  # no bytes, no memory to share (empty tensors' addresses may coincide)
            kept[(name,)] = name
            continue
        key = (str(t.device), t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        first = kept.get(key)
        if first is None:
            spans.append((key[0], t.data_ptr(), t.data_ptr() + _span(t), key))
        if first is None or (first in tied and name not in tied):  # the tied source wins the name
            kept[key] = name
    names = set(kept.values())
    spans.sort(key=lambda s: s[:3])
    problems = [f"{kept[b]}: overlaps {kept[a]} in memory without being the same tensor"
                for (dev_a, _, end, a), (dev_b, start, _, b) in zip(spans, spans[1:]) if dev_a == dev_b and start < end]
    if problems:
        raise LayoutError("tensors of the state dict overlap; each byte can be published once", problems)
    return {name: t for name, t in state_dict.items() if name in names}


def _span(t) -> int:
    """Bytes from the tensor's first element to just past its last."""
    return (1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))) * t.element_size()


def publish(ep, model_name: str, version: int, hf_model_or_state_dict, *, chunk_bytes: Optional[int] = None,
            timeout: float = 10.0):
    """Publish a transformers model (or its state dict) as ``model_name@version`` by HF
    names; returns the manifest. See the module docstring for tied and non-contiguous
    tensors."""
    state_dict, tied = _state_dict(hf_model_or_state_dict)
    tensors = {name: t if t.is_contiguous() else t.contiguous() for name, t in distinct(state_dict, tied).items()}
    return ep.publish(model_name, version, tensors, chunk_bytes=chunk_bytes, timeout=timeout)


def destination(hf_model) -> dict:
    """The model's own tensors a fetch writes, by HF name, tied weights once."""
    state_dict, tied = _state_dict(hf_model)
    return distinct(state_dict, tied)


def fetch(ep, model_name: str, version, hf_model, *, timeout: float = 60.0, **fetch_kw) -> int:
    """Fetch ``model_name@version`` (an int or ``"latest"``) into ``hf_model``'s own
    parameters and buffers, in place; returns the version fetched. ``fetch_kw`` go to
    ``Endpoint.fetch`` (``group``, ``wait``, ``window``...)."""
    return ep.fetch(model_name, version, into=destination(hf_model), timeout=timeout, **fetch_kw)


def fetch_state_dict(ep, model_name: str, version="latest", *, device="cpu", timeout: float = 60.0,
                     **fetch_kw) -> tuple[int, dict]:
    """``(version, state_dict)``: ``model_name@version`` fetched into fresh tensors on
    ``device`` (the endpoint's), one per tensor name of the version."""
    made: dict = {}

    def fresh(shards) -> dict:
        made.update(allocate_global(shards, device))
        return made

    got = ep.fetch(model_name, version, into=fresh, timeout=timeout, **fetch_kw)
    if not made:  # the endpoint already held that version and returned without fetching
        raise EndpointError(f"{ep.name} already holds {model_name}@{got}; fetch_state_dict needs fresh memory: "
                            f"fetch into the memory that holds it, or unpublish {model_name}@{got} first")
    return got, made


def allocate_global(shards, device="cpu") -> dict:
    """Fresh tensors, one per tensor name of the manifests ``shards``, of its global
    shape (unlike ``layout.allocate``'s one per piece): a whole-model destination."""
    import torch

    out: dict = {}
    for m in shards:
        for t in m.tensors:
            if t.name not in out:
                out[t.name] = torch.empty(t.global_shape or t.shape, dtype=getattr(torch, t.dtype), device=device)
    return out


def check_dir(path) -> dict[str, list[str]]:
    """``{shard file: [tensor names]}`` of the HF checkpoint directory ``path``, checked
    (every shard present, a safetensors file, holding what the index says) without
    reading any weight; ``CheckpointError`` naming the path, file or tensor at fault."""
    from safetensors import safe_open

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: {'not a directory' if root.exists() else 'no such directory'}")
    if (root / INDEX).is_file():
        shards = _read_index(root)
    elif (root / SINGLE).is_file():
        shards = {SINGLE: None}
    else:
        raise CheckpointError(f"{root}: neither {INDEX} (a sharded checkpoint) nor {SINGLE} is in this directory")
    out: dict[str, list[str]] = {}
    for file, names in shards.items():
        where = root / file
        if not where.is_file():
            raise CheckpointError(f"{root}: shard {file} is missing (the index maps {len(names)} tensor(s) to it, "
                                  f"{names[0]} first)")
        try:
            with safe_open(str(where), framework="pt") as f:
                held = set(f.keys())
        except Exception as exc:
            raise CheckpointError(f"{where}: not a safetensors file ({exc})") from None
        if names is None:
            if not held:
                raise CheckpointError(f"{where}: holds no tensors")
            names = sorted(held)
        absent = [n for n in names if n not in held]
        if absent:
            raise CheckpointError(f"{where}: tensor {absent[0]} is not in this shard, though {INDEX} maps it there"
                                  + (f" ({len(absent) - 1} more)" if len(absent) > 1 else ""))
        out[file] = names
    return out


def _read_index(root: Path) -> dict[str, list[str]]:
    try:
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{root / INDEX}: not an index with a weight_map ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{root / INDEX}: weight_map must map tensor names to shard files; it is empty or not "
                              "an object")
    shards: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise CheckpointError(f"{root / INDEX}: weight_map[{name!r}] = {file!r} is not a file name in the "
                                  "directory")
        shards.setdefault(file, []).append(name)
    return shards


def read_dir(path) -> dict:
    """``{name: tensor}`` of the HF checkpoint directory ``path`` (memory-mapped), shard
    by shard; ``CheckpointError`` naming what is wrong."""
    from safetensors import safe_open

    root = Path(path)
    out: dict = {}
    for file, names in check_dir(root).items():
        with safe_open(str(root / file), framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name)
    return out
