"""HF names → a loaded SGLang model's own parameters (contract 9), by ``engine_map``'s
probe, and the pause that applies a shard read into a shadow.

Protocol. ``derive(model, tensors)`` (``tensors``: {HF name: (global shape, dtype
name)}, from the version's manifest) → an ``EngineMap``, or ``Unmapped`` saying why.
SGLang's models keep vLLM's loader contract: ``model.load_weights(iterable of (HF
name, tensor))`` calls, per tensor, ``param.weight_loader(param, tensor[, shard id])``
(``getattr(param, "weight_loader", default_weight_loader)`` where a parameter has
none: norms), and that loader slices the TP rank's part, fuses q/k/v and gate/up, or
pads a vocabulary. Unlike vLLM there is no separate raw form to restore: inside
SGLang's weight-update session (``begin_weight_update`` puts packed weights back in
their loader form, ``end_weight_update`` runs the post-load steps) the live
parameters are what the loaders write. So the recording swaps each live parameter's
loader for a recorder (``engine_map.Recording``; a parameter shared by two modules, a
tied ``lm_head``, once), runs ``load_weights`` over meta stand-ins (no bytes: nothing
of the model can be written), puts every loader back, and ``engine_map.plan``
replays each call into integer probes. Every mapped layer is ``copy``.

Refused (``Unmapped``, the caller takes the whole-tensor path): a model without
``load_weights``, a ``load_weights`` that fails over stand-ins or loads nothing through
a weight loader, a loader that cannot be swapped (a read-only ``weight_loader``
property) or that changes the tensor (``engine_map``), a layer with a quantized
``quant_method`` (its scales and packing are SGLang's to load: not tried here).

``apply(model, emap, shadow)`` → seconds: each raw parameter's shadow copied into the
live parameter in place (same storage: a CUDA graph that holds its address keeps
working). The shadow is never written: it stays the replica others read.

Must run on the scheduler's thread with nothing else using the model (SGLang's
``update_weights_from_tensor`` calls the loader there, generation paused).
"""

from __future__ import annotations

import time

from .engine_map import EngineMap, Recording, Unmapped, plan


def _default_loader():
    """SGLang's own ``default_weight_loader`` where SGLang is importable; else one with
    its documented behaviour (a scalar fills, anything else is copied whole)."""
    try:
        from sglang.srt.model_loader.weight_utils import default_weight_loader
    except Exception:  # (SGLang is not installed: a stand-in model's tests)
        def default_weight_loader(param, loaded_weight) -> None:
            if param.numel() == 1 and loaded_weight.numel() == 1:
                param.data.fill_(loaded_weight.item())
            else:
                assert param.size() == loaded_weight.size(), (
                    f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})")
                param.data.copy_(loaded_weight)
    return default_weight_loader


def _quantized(layer) -> bool:
    method = getattr(layer, "quant_method", None)
    return method is not None and not type(method).__name__.startswith("Unquantized")


def _record(model, tensors: dict):
    layers, raws, seen = {}, {}, set()
    recording = Recording()
    default = _default_loader()
    problems = []
    try:
        for path, layer in model.named_modules():
            params = {n: p for n, p in layer._parameters.items() if p is not None and id(p) not in seen}
            if not params:
                continue
            if _quantized(layer):
                problems.append(f"{type(layer).__name__}: quantized ({type(layer.quant_method).__name__})")
                continue
            layers[path], raws[path] = layer, {}
            for name, param in params.items():
                seen.add(id(param))
                raws[path][name] = param
                try:
                    recording.instrument(path, name, param, getattr(param, "weight_loader", default))
                except AttributeError as exc:
                    problems.append(f"{type(layer).__name__}.{name}: its weight_loader cannot be swapped ({exc})")
        if problems:
            raise Unmapped("cannot map the model's parameters", problems)
        try:
            model.load_weights(recording.stand_ins(tensors))
        except Exception as exc:
            raise Unmapped("the model's load_weights", [f"it failed over stand-ins ({type(exc).__name__}: {exc})"]) \
                from exc
    finally:
        recording.undo()
    return recording.calls, layers, raws


def derive(model, tensors: dict) -> EngineMap:
    """See the module. Raises ``Unmapped`` naming every class it could not map."""
    if not callable(getattr(model, "load_weights", None)):
        raise Unmapped("cannot map the model's parameters", [f"{type(model).__name__}: no load_weights"])
    calls, layers, raws = _record(model, tensors)
    out, classes, problems, seen = plan(calls, layers, raws, tensors, lambda layer: "copy")
    if not out and not problems:
        problems["load_weights"] = "it loads nothing through a parameter's weight_loader"
    if problems:
        raise Unmapped("cannot map the model's parameters", [f"{c}: {why}" for c, why in sorted(problems.items())])
    return EngineMap(out, dict(tensors), classes, sorted(set(tensors) - seen))


def apply(model, emap: EngineMap, shadow: dict) -> float:
    """The pause: every raw parameter's shadow into the live parameter, in place. Every
    shape and dtype is checked before the first copy: a mismatch changes nothing."""
    started = time.monotonic()
    modules = dict(model.named_modules())
    pairs, problems = [], []
    for path, lp in emap.layers.items():
        for name in lp.params:
            live, values = getattr(modules[path], name), shadow[f"{path}:{name}"]
            if tuple(live.shape) != tuple(values.shape) or live.dtype != values.dtype:
                problems.append(f"{path}.{name}: the model holds {list(live.shape)} {live.dtype}, the shadow "
                                f"{list(values.shape)} {values.dtype}")
            pairs.append((live, values))
    if problems:
        raise RuntimeError("the shadow does not fit the model; nothing was copied: " + "; ".join(problems[:8]))
    for live, values in pairs:
        live.data.copy_(values)
    return time.monotonic() - started
