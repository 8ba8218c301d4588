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

import inspect
import logging
from dataclasses import dataclass, field

from .boxes import Box
from .targets import Slot, Target

log = logging.getLogger(__name__)

ALIGN = 64


class Unmapped(Exception):
    """The model's parameters cannot all be mapped; ``problems`` names each class."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message + ": " + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
        self.problems = problems


@dataclass
class ParamPlan:
    shape: tuple
    dtype: object  # torch dtype
    # (HF name, box in the HF tensor, region in the raw parameter: per dim (start, stop, squeeze))
    slots: list = field(default_factory=list)


@dataclass
class LayerPlan:
    path: str
    mode: str  # "copy" or "process"
    params: dict[str, ParamPlan]
    shared: dict[str, str] = field(default_factory=dict)  # raw param -> "path:param" whose shadow it reuses (tied)


@dataclass
class EngineMap:
    layers: dict[str, LayerPlan]
    tensors: dict  # {HF name: (global shape, dtype name)} it was derived for
    classes: dict[str, str]
    ignored: list[str]  # HF names the model's load_weights does not load

    def keys(self):
        for path, lp in self.layers.items():
            for name in lp.params:
                yield f"{path}:{name}"

    @property
    def shard_bytes(self) -> int:
        """The bytes of the HF tensors this worker's slots name (its shard)."""
        import torch

        total = 0
        for lp in self.layers.values():
            for pp in lp.params.values():
                size = torch.empty((), dtype=pp.dtype).element_size()
                total += sum(box.volume for _, box, _ in pp.slots) * size
        return total

    def check(self, tensors: dict) -> list[str]:
        """Problems of a version's tensors against the map: a tensor the map reads that
        is missing or has another shape or dtype. Tensors it does not read (a tied
        ``lm_head`` a trainer's state_dict repeats) are left alone."""
        problems = []
        for name, (shape, dtype) in tensors.items():
            if name in self.ignored or name not in self.tensors:
                continue
            if tuple(self.tensors[name][0]) != tuple(shape) or self.tensors[name][1] != dtype:
                problems.append(f"{name}: {list(shape)} {dtype}, the map has {list(self.tensors[name][0])} "
                                f"{self.tensors[name][1]}")
        problems += [f"{name}: missing from the version" for name in self.tensors
                     if name not in tensors and name not in self.ignored]
        return problems

    def allocate(self, device) -> dict:
        """{key: a zeroed raw-shaped tensor}: one shadow of this worker's shard, one
        buffer per dtype (one registration each)."""
        import torch

        plans = [(f"{path}:{n}", pp) for path, lp in self.layers.items() for n, pp in lp.params.items()]
        out = {}
        for dtype in {pp.dtype for _, pp in plans}:
            mine = [(k, pp) for k, pp in plans if pp.dtype == dtype]
            size = torch.empty((), dtype=dtype).element_size()
            offsets, at = [], 0
            for _, pp in mine:
                offsets.append(at)
                n = 1
                for s in pp.shape:
                    n *= s
                at += -(-n * size // ALIGN) * ALIGN
            flat = torch.zeros(max(at, ALIGN), dtype=torch.uint8, device=device)
            for (k, pp), off in zip(mine, offsets):
                n = 1
                for s in pp.shape:
                    n *= s
                out[k] = flat[off:off + n * size].view(dtype).view(pp.shape)
        return out

    def targets(self, shadow: dict) -> dict:
        out = {}
        for path, lp in self.layers.items():
            for name, pp in lp.params.items():
                t = shadow[f"{path}:{name}"]
                slots = [Slot(hf, box, t[_index(region)], tuple(self.tensors[hf][0])) for hf, box, region in pp.slots]
                out[f"{path}:{name}"] = Target(t, slots)
        return out


def _index(region) -> tuple:
    return tuple(start if squeeze else slice(start, stop) for start, stop, squeeze in region)


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


class _Call:
    __slots__ = ("hf", "layer", "param", "meta", "loader", "bound", "same")

    def __init__(self, hf, layer, param, meta, loader, bound, same):
        self.hf, self.layer, self.param, self.meta, self.loader, self.bound, self.same = \
            hf, layer, param, meta, loader, bound, same


def _record(model, tensors: dict) -> tuple[list[_Call], dict, dict]:
    """Run ``model.load_weights`` over stand-ins with raw meta parameters that record
    each loader call. Returns (calls, {path: layer}, {path: {param: raw meta}})."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, restore_layer_on_meta

    layers, raws, saved = {}, {}, {}
    calls: list[_Call] = []
    current = {"hf": None, "sent": None}
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
                original = _get_original_loader(meta)

                def recorder(*args, _path=path, _name=name, _meta=meta, _orig=original, **kwargs):
                    bound = inspect.signature(_orig).bind(*args, **kwargs)
                    values = list(bound.arguments.values())
                    loaded, sent = (values[1] if len(values) > 1 else None), current["sent"]
                    # The tensor given, or a view of it laid out as it (a dummy expert dim
                    # added and taken off again): anything else was changed on the way.
                    same = loaded is sent or (
                        isinstance(loaded, torch.Tensor) and sent is not None and loaded._base is sent
                        and loaded.shape == sent.shape and loaded.stride() == sent.stride()
                        and loaded.storage_offset() == sent.storage_offset())
                    calls.append(_Call(current["hf"], _path, _name, _meta, _orig, bound, same))
                    return True

                meta.__dict__["_th_loader"] = (original, "weight_loader" in meta.__dict__
                                               or isinstance(getattr(type(meta), "weight_loader", None), property))
                meta.weight_loader = recorder

        def stand_ins():
            for hf, (shape, dtype) in tensors.items():
                t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")  # (no bytes)
                current["hf"], current["sent"] = hf, t
                yield hf, t
            current["hf"], current["sent"] = None, None

        model.load_weights(stand_ins())
    finally:
        for path, per in raws.items():
            for meta in per.values():
                kept = meta.__dict__.pop("_th_loader", None)
                if kept is not None:
                    if kept[1]:
                        meta.weight_loader = kept[0]
                    else:
                        meta.__dict__.pop("weight_loader", None)
        for path, snap in saved.items():
            restore(layers[path], snap)
    return calls, layers, raws


def _probe(call: _Call, gshape: tuple):
    """Replay ``call`` into an int probe per source dim: the (box, region) it writes,
    None when it writes nothing; raises ValueError when what it writes is not a box of
    the source landing as it lies in a box of the parameter."""
    import torch

    meta = call.meta
    shape = tuple(meta.shape)
    nd, d = len(shape), len(gshape)
    if nd < d:
        raise ValueError(f"the parameter has {nd} dims, the HF tensor {d}")
    region, box_off, box_size, volume = None, [], [], 0
    for k in range(max(d, 1)):
        probe = torch.zeros(shape, dtype=torch.int64)
        probe.__class__ = meta.__class__
        probe.__dict__ = meta.__dict__.copy()
        probe.__dict__.pop("_th_loader", None)
        if d:
            view = [1] * d
            view[k] = gshape[k]
            src = torch.arange(1, gshape[k] + 1, dtype=torch.int64).view(view).expand(gshape)
        else:
            src = torch.ones((), dtype=torch.int64)
        args = dict(call.bound.arguments)
        names = list(args)
        args[names[0]], args[names[1]] = probe, src
        bound = inspect.signature(call.loader).bind_partial()
        bound.arguments.update(args)
        call.loader(*bound.args, **bound.kwargs)
        plain = probe.as_subclass(torch.Tensor)
        mask = plain != 0
        count = int(mask.sum())
        if count == 0:
            return None
        if region is not None and count != volume:
            raise ValueError(f"the loader writes elsewhere for dim {k} of the HF tensor")
        if region is None:
            region = []
            for j in range(nd):
                others = tuple(i for i in range(nd) if i != j)
                along = mask.amax(dim=others) if others else mask
                idx = along.nonzero().flatten()
                lo, hi = int(idx[0]), int(idx[-1]) + 1
                region.append((lo, hi, j < nd - d))
            volume = 1
            for lo, hi, _ in region:
                volume *= hi - lo
            if volume != count:
                raise ValueError("what the loader writes is not one box of the parameter")
            if any(hi - lo != 1 for lo, hi, sq in region if sq):
                raise ValueError("the loader writes more than one slice along a dim the HF tensor lacks")
        inside = plain[_index(region)]
        if not d:
            if inside.numel() != 1 or int(inside) != 1:
                raise ValueError("a scalar lands changed")
            break
        j = nd - d + k
        lo, hi, _ = region[j]
        first = int(inside.min())
        want = torch.arange(first, first + hi - lo, dtype=torch.int64)
        shape_k = [1] * inside.dim()
        shape_k[k] = hi - lo
        if inside.shape[k] != hi - lo or not torch.equal(inside, want.view(shape_k).expand(inside.shape)):
            raise ValueError(f"dim {k} of the HF tensor does not land as it lies (transposed, permuted or changed)")
        if first - 1 + hi - lo > gshape[k]:
            raise ValueError(f"dim {k}: the landed range passes the HF tensor's end")
        box_off.append(first - 1)
        box_size.append(hi - lo)
    return Box(tuple(box_off), tuple(box_size)), tuple(region)


def _key(call: _Call, layer, gshape, dtype) -> tuple:
    extra = []
    for i, (name, value) in enumerate(call.bound.arguments.items()):
        if i < 2 or (isinstance(value, str) and "." in value):
            continue  # (the parameter, the tensor, and names: the same for every layer)
        extra.append((name, repr(value)))
    return (type(layer).__name__, call.param, tuple(call.meta.shape), str(call.meta.dtype), tuple(gshape), dtype,
            tuple(extra))


def _mode(layer) -> str:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return "process" if isinstance(getattr(layer, "quant_method", None), QuantizeMethodBase) else "copy"


def derive(model, tensors: dict) -> EngineMap:
    """See the module. Raises ``Unmapped`` naming every class it could not map."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    from .boxes import intersect

    calls, layers, raws = _record(model, tensors)
    problems: dict[str, str] = {}
    cache: dict = {}
    slots: dict[tuple, list] = {}
    seen = set()
    for call in calls:
        layer = layers[call.layer]
        cls = f"{type(layer).__name__}.{call.param}"
        if call.hf is None:
            problems.setdefault(cls, "loaded from something other than the checkpoint's tensors")
            continue
        seen.add(call.hf)
        if not call.same:
            problems.setdefault(cls, f"{call.hf}: the model's load_weights changes the tensor before its loader")
            continue
        gshape, dtype = tensors[call.hf]
        if str(call.meta.dtype) != f"torch.{dtype}":  # (the loader would cast: the shadow holds the raw dtype)
            problems.setdefault(cls, f"{call.hf}: {dtype} in the checkpoint, {call.meta.dtype} in the model")
            continue
        key = _key(call, layer, gshape, dtype)
        if key not in cache:
            try:
                cache[key] = _probe(call, tuple(gshape))
            except Exception as exc:
                cache[key] = exc
        got = cache[key]
        if isinstance(got, Exception):
            problems.setdefault(cls, f"{call.hf}: {got}")
            continue
        if got is not None:
            slots.setdefault((call.layer, call.param), []).append((call.hf, got[0], got[1]))
    out, classes = {}, {}
    for path, per in raws.items():
        layer = layers[path]
        mapped = {name: (path, name) in slots for name in per}
        if not any(mapped.values()):
            continue
        for name, meta in per.items():
            cls = f"{type(layer).__name__}.{name}"
            if not mapped[name]:
                problems.setdefault(cls, "a raw parameter no checkpoint tensor lands in")
                continue
            regions = [Box(tuple(lo for lo, _, _ in r), tuple(hi - lo for lo, hi, _ in r))
                       for _, _, r in slots[(path, name)]]
            for i, a in enumerate(regions):
                if any(intersect(a, b) is not None for b in regions[:i]):
                    problems.setdefault(cls, "two checkpoint tensors land on the same elements")
                    break
        mode = _mode(layer)
        if mode == "process" and LAYERWISE_INFO[layer].restore_metadata[1]:
            problems.setdefault(type(layer).__name__, "a layer vLLM post-processes that also holds buffers")
        params = {name: ParamPlan(tuple(meta.shape), meta.dtype, slots.get((path, name), [])) for name, meta in per.items()}
        out[path] = LayerPlan(path, mode, params)
        for name in per:
            classes[f"{type(layer).__name__}.{name}"] = mode
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
