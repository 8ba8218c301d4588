"""HF names → a loaded vLLM model's own parameters, derived from the model (contract 9).

Protocol. ``derive(model, tensors)`` (``tensors``: {HF name: (global shape, dtype name)},
from a manifest or a checkpoint's headers) → an ``EngineMap``, or ``Unmapped`` naming
each parameter class it could not map. Nothing is hand-written per architecture: the
model's own ``load_weights`` is run once over stand-ins (meta tensors: no bytes)
with every parameter in its raw (loader) form, as vLLM's layerwise reload restores it
(``record_metadata_for_reloading``'s metadata), and each call it makes into a
parameter's weight loader is recorded: which HF tensor, which parameter, which shard
id. Each recorded call is then replayed into an integer probe of the parameter's raw
shape, once per source dimension, with the source holding its own index along that
dimension: where the loader writes, and what, gives the box of the HF tensor and the
region of the parameter it lands in (the TP slice, the q/k/v or gate/up offset, the
expert; padding is where nothing lands). A loader that transposes, permutes, scales
or repacks fails the check, and so does a model whose ``load_weights`` hands the
loader anything but the tensor it was given. Replays are cached per layer class and
shape, so a 60-layer model probes about one layer.

The engine-neutral part (the recording, the probe, ``EngineMap``) is ``engine_map``;
this module is vLLM's side: the raw parameters come from vLLM's reload metadata.

``EngineMap``: ``layers`` (module path → ``LayerPlan``: its raw parameters, and how the
pause applies them: ``copy`` into the live parameter in place, or ``process``: raw
values through the layer's ``quant_method.process_weights_after_loading``, then
copied into the kernel tensors, as vLLM's reload does, for layers vLLM repacks or
quantizes), ``allocate(device)`` (one shadow: every raw parameter of this worker, its
shard only, carved from one buffer per dtype), ``targets(shadow)`` (the fetch
destination: a ``Target`` per raw parameter), ``shard_bytes``, ``classes`` (per
parameter class, ``copy`` or ``process``: what the adapter reports), ``check(tensors)``
(problems: a version whose tensors differ from those the map was derived for).
``apply(model, map, shadow)`` (``vllm_apply``) is the pause.

Must run on the worker's own thread with nothing else using the model: the recording
swaps each layer's parameters for its raw meta ones and puts them back (always).
"""

from __future__ import annotations

import logging

from .engine_map import ALIGN, EngineMap, LayerPlan, ParamPlan, Recording, Unmapped, _Call, plan

log = logging.getLogger(__name__)
__all__ = ["ALIGN", "EngineMap", "LayerPlan", "ParamPlan", "Unmapped", "checkpoint_tensors", "derive"]


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def checkpoint_tensors(path) -> dict | None:
    """{HF name: (shape, dtype name)} from the safetensors headers of a local model
    directory (no tensor bytes read); None where there are none."""
    import json
    import struct
    from pathlib import Path

    files = sorted(Path(path).glob("*.safetensors")) if path and Path(path).is_dir() else []
    if not files:
        return None
    out = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (tuple(meta["shape"]), _DTYPES.get(meta["dtype"], meta["dtype"].lower()))
    return out


def snapshot(layer) -> tuple:
    """What ``restore`` puts back: the layer's parameter and buffer tables as they are
    (``None`` entries, a bias a layer was built without, included) and which buffers
    are not persistent."""
    return dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set)


def restore(layer, snap: tuple) -> None:
    params, buffers, non_persistent = snap
    layer._parameters.clear()
    layer._parameters.update(params)
    layer._buffers.clear()
    layer._buffers.update(buffers)
    layer._non_persistent_buffers_set.clear()
    layer._non_persistent_buffers_set.update(non_persistent)



def _record(model, tensors: dict) -> tuple[list[_Call], dict, dict]:
    """Run ``model.load_weights`` over stand-ins with raw meta parameters that record
    each loader call. Returns (calls, {path: layer}, {path: {param: raw meta}})."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, restore_layer_on_meta

    layers, raws, saved = {}, {}, {}
    recording = Recording()
    for path, layer in model.named_modules():
        if any(p is not None for p in layer._parameters.values()):
            layers[path] = layer
    missing = [path for path, layer in layers.items() if LAYERWISE_INFO.get(layer) is None]
    if missing:
        raise Unmapped("no reload metadata", [f"{path}: vLLM recorded none for it" for path in missing])
    try:
        for path, layer in layers.items():
            info = LAYERWISE_INFO[layer]
            saved[path] = snapshot(layer)
            restore_layer_on_meta(layer, info)
            raws[path] = {}
            # Every parameter records, the live ones restore_layer_on_meta leaves (a bias)
            # included: a stand-in must never reach a real loader.
            for name, meta in list(layer._parameters.items()):
                if meta is None or name in SKIP_LOAD_TENSORS:
                    continue
                raws[path][name] = meta
                # (vLLM's layerwise reload leaves its wrapper on the metadata it restores)
                recording.instrument(path, name, meta, _get_original_loader(meta))
        model.load_weights(recording.stand_ins(tensors))
    finally:
        recording.undo()
        for path, snap in saved.items():
            restore(layers[path], snap)
    return recording.calls, layers, raws


def _mode(layer) -> str:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return "process" if isinstance(getattr(layer, "quant_method", None), QuantizeMethodBase) else "copy"



def derive(model, tensors: dict) -> EngineMap:
    """See the module. Raises ``Unmapped`` naming every class it could not map."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    calls, layers, raws = _record(model, tensors)
    out, classes, problems, seen = plan(calls, layers, raws, tensors, _mode)
    for path, lp in out.items():
        if lp.mode == "process" and LAYERWISE_INFO[layers[path]].restore_metadata[1]:
            problems.setdefault(type(layers[path]).__name__, "a layer vLLM post-processes that also holds buffers")
    if problems:
        raise Unmapped("cannot map the model's parameters", [f"{c}: {why}" for c, why in sorted(problems.items())])
    _tie(model, layers, raws, out, classes)
    ignored = sorted(set(tensors) - seen)
    return EngineMap(out, dict(tensors), classes, ignored)


def _tie(model, layers, raws, out, classes) -> None:
    """A layer that shares a live parameter with a mapped layer (a tied ``lm_head``)
    and has none of its own mapped is processed too, from that layer's shadow."""
    owner = {}
    for path, lp in out.items():
        for name in lp.params:
            owner[id(getattr(layers[path], name))] = f"{path}:{name}"
    for path, per in raws.items():
        if path in out:
            continue
        layer = layers[path]
        shared = {name: owner.get(id(layer._parameters.get(name))) for name in per}
        if per and all(shared.values()) and _mode(layer) == "process":
            out[path] = LayerPlan(path, "process", {}, shared)
            for name in per:
                classes[f"{type(layer).__name__}.{name}"] = "process (tied)"
