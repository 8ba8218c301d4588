"""The pause: a verified shadow (``vllm_map``) into a loaded vLLM model's live parameters.

Protocol. ``apply(model, emap, shadow)`` → {mode: seconds}. Per layer of the map, in
model order:

- ``copy``: each raw parameter's shadow is copied into the live parameter in place
  (same storage, so anything holding its address, a CUDA graph, keeps working);
- ``process``: the layer vLLM repacks or quantizes after loading (its
  ``quant_method.process_weights_after_loading``: a oneDNN handle on CPU, fp8 scales):
  its raw parameters are put back (vLLM's reload metadata) holding a copy of the
  shadow, the layer's own post-load step runs, and what it produced is copied into the
  kernel tensors the model already holds, which are then put back: what vLLM's
  layerwise reload does after ``load_weights``, without ``load_weights`` (the shadow
  is already this worker's shard, sliced and fused).

The shadow is never written (the post-load step works on a copy): it stays the
published replica other readers pull from. Raises on any mismatch before the layer at
fault changed; a failure part way leaves earlier layers on the new version (the
caller applies the previous shadow back).

``prepare(model, emap, shadow)`` (outside the pause, while the engine generates) runs
the post-load step of ``process`` layers whose step only touches the layer it is given
(``PREPARABLE``: vLLM's unquantized linear and embedding methods, on CPU, where they
pack weights for oneDNN; elsewhere they do nothing) on a stand-in of the layer; ``apply(..., prepared)`` then only copies its parameters into the kernel tensors
and sets what the step made (a oneDNN handle on CPU) on the live layer.
"""

from __future__ import annotations

import time


def _process(layer, raws: dict) -> None:
    """``raws``: {param name: tensor with the raw values (a copy we may give away)}."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    from .vllm_map import restore, snapshot

    info = LAYERWISE_INFO[layer]
    snap = snapshot(layer)
    params = {name: p for name, p in snap[0].items() if p is not None}
    restore_layer_on_meta(layer, info)
    try:
        for name, values in raws.items():
            meta = layer._parameters[name]
            values.__class__ = meta.__class__
            values.__dict__ = meta.__dict__.copy()
            setattr(layer, name, values)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
        for name, kernel in params.items():
            made = getattr(layer, name)
            if tuple(made.shape) != tuple(kernel.shape) or made.dtype != kernel.dtype:
                raise RuntimeError(f"{type(layer).__name__}.{name}: the post-load step made "
                                   f"{list(made.shape)} {made.dtype}, the model holds {list(kernel.shape)} {kernel.dtype}")
            if made.data_ptr() != kernel.data_ptr():
                kernel.data.copy_(made.data)
    finally:
        restore(layer, snap)


# Post-load steps that only touch the layer they are given (a oneDNN handle and a
# parameter on CPU, nothing on CUDA): safe to run on a stand-in of the layer while the
# real one serves. Others (a fused-MoE method keeps kernel state on itself) run in the pause.
PREPARABLE = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


def prepare(model, emap, shadow: dict) -> dict:
    """Outside the pause: each ``process`` layer whose post-load step is ``PREPARABLE``
    runs it now on a stand-in (a shallow copy of the layer with parameters of its own,
    holding a copy of the shadow). Returns {path: stand-in} for ``apply``."""
    import copy

    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from vllm.platforms import current_platform

    out = {}
    if not current_platform.is_cpu():
        return out  # (elsewhere these steps do nothing: a stand-in would only cost a copy of the shard)
    with torch.no_grad():
        for path, lp in emap.layers.items():
            layer = model.get_submodule(path)
            if lp.mode != "process" or type(layer.quant_method).__name__ not in PREPARABLE:
                continue
            metas = LAYERWISE_INFO[layer].restore_metadata[0]
            stand_in = copy.copy(layer)
            stand_in._parameters = dict(layer._parameters)
            stand_in._buffers = dict(layer._buffers)
            keys = {name: f"{path}:{name}" for name in lp.params} | lp.shared
            for name, key in keys.items():
                values = shadow[key].clone()
                like = metas.get(name, layer._parameters.get(name))
                values.__class__ = like.__class__
                values.__dict__ = like.__dict__.copy()
                stand_in._parameters[name] = values
            stand_in.quant_method.process_weights_after_loading(stand_in)
            out[path] = stand_in
    return out


def _transplant(layer, stand_in) -> None:
    """The stand-in's post-load results into the live layer: parameters copied into
    the kernel tensors, new attributes (a oneDNN handle) set."""
    kernels = {name: p for name, p in layer._parameters.items() if p is not None}
    for name, kernel in kernels.items():
        made = stand_in._parameters.get(name)
        if made is None or tuple(made.shape) != tuple(kernel.shape) or made.dtype != kernel.dtype:
            raise RuntimeError(f"{type(layer).__name__}.{name}: the post-load step made "
                               f"{None if made is None else list(made.shape)}, the model holds {list(kernel.shape)}")
    for name, kernel in kernels.items():
        made = stand_in._parameters[name]
        if made.data_ptr() != kernel.data_ptr():
            kernel.data.copy_(made.data)
    for key, value in stand_in.__dict__.items():
        if key not in ("_parameters", "_buffers", "_modules") and layer.__dict__.get(key) is not value:
            layer.__dict__[key] = value


def apply(model, emap, shadow: dict, prepared: dict | None = None) -> dict:
    import torch

    spent = {"copy": 0.0, "process": 0.0, "prepared": 0.0}
    prepared = prepared or {}
    with torch.no_grad():
        for path, lp in emap.layers.items():
            started = time.monotonic()
            layer = model.get_submodule(path)
            if path in prepared:
                _transplant(layer, prepared[path])
                spent["prepared"] += time.monotonic() - started
                continue
            if lp.mode == "copy":
                for name in lp.params:
                    live = getattr(layer, name)
                    src = shadow[f"{path}:{name}"]
                    if tuple(live.shape) != tuple(src.shape):
                        raise RuntimeError(f"{path}.{name}: the model holds {list(live.shape)}, the shadow "
                                           f"{list(src.shape)}")
                    live.data.copy_(src)
            else:
                raws = {name: shadow[f"{path}:{name}"].clone() for name in lp.params}
                raws |= {name: shadow[key].clone() for name, key in lp.shared.items()}
                _process(layer, raws)
            spent[lp.mode] += time.monotonic() - started
    return spent
