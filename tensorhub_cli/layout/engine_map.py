"""HF names → an inference engine's own parameters, derived from the loaded model by
probing its weight loaders (contract 9): the engine-neutral part of ``vllm_map`` and
``sglang_map``.

Protocol. Both engines' models load a checkpoint the same way: ``load_weights(iterable
of (HF name, tensor))`` calls, per tensor, a parameter's ``weight_loader(param, tensor,
[shard id])``, which slices this rank's part (TP), fuses (q/k/v, gate/up offsets) or
stacks (experts). The engine module records those calls over stand-ins (meta tensors:
no bytes) with ``Recording``: ``instrument(path, name, param, original)`` swaps a
parameter's loader for a recorder (``undo`` puts it back, always), ``stand_ins(tensors)``
is what ``load_weights`` is given, ``calls`` what it did. ``plan(calls, layers, raws,
tensors, mode_of)`` replays each recorded call into an integer probe of the
parameter's shape, once per source dimension (``_probe``, cached per layer class and
shape: a 60-layer model probes about one layer): where the loader writes, and what,
gives the box of the HF tensor and the region of the parameter it lands in. A loader
that transposes, permutes, scales or repacks fails the probe, and so does a model
whose ``load_weights`` hands the loader anything but the tensor it was given.

``EngineMap``: ``layers`` (module path → ``LayerPlan``: its raw parameters and how the
pause applies them: ``copy`` in place, or vLLM's ``process``), ``allocate(device)`` (one
shadow: every raw parameter of this worker, its shard only, carved from one buffer per
dtype), ``targets(shadow)`` (the fetch destination: a ``Target`` per raw parameter),
``shard_bytes``, ``classes`` (per parameter class, its mode), ``check(tensors)``
(problems: a version whose tensors differ from those the map was derived for).
``Unmapped`` names each parameter class that could not be mapped.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from .boxes import Box
from .targets import Slot, Target

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



class _Call:
    __slots__ = ("hf", "layer", "param", "meta", "loader", "bound", "same")

    def __init__(self, hf, layer, param, meta, loader, bound, same):
        self.hf, self.layer, self.param, self.meta, self.loader, self.bound, self.same = \
            hf, layer, param, meta, loader, bound, same



class Recording:
    """The loader calls ``load_weights`` makes over stand-ins (see the module)."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.current = {"hf": None, "sent": None}
        self._swapped: list = []

    def instrument(self, path: str, name: str, param, original) -> None:
        """``param.weight_loader`` records instead of loading (``original``: the loader
        it stands for, replayed by ``plan``); a stand-in must never reach a real loader."""
        import torch

        current, calls = self.current, self.calls

        def recorder(*args, **kwargs):
            bound = inspect.signature(original).bind(*args, **kwargs)
            values = list(bound.arguments.values())
            loaded, sent = (values[1] if len(values) > 1 else None), current["sent"]
            # The tensor given, or a view of it laid out as it (a dummy expert dim
            # added and taken off again): anything else was changed on the way.
            same = loaded is sent or (
                isinstance(loaded, torch.Tensor) and sent is not None and loaded._base is sent
                and loaded.shape == sent.shape and loaded.stride() == sent.stride()
                and loaded.storage_offset() == sent.storage_offset())
            calls.append(_Call(current["hf"], path, name, param, original, bound, same))
            return True

        own = "weight_loader" in param.__dict__ or isinstance(getattr(type(param), "weight_loader", None), property)
        param.__dict__["_th_loader"] = (original, own)
        self._swapped.append(param)
        param.weight_loader = recorder

    def stand_ins(self, tensors: dict):
        import torch

        for hf, (shape, dtype) in tensors.items():
            t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device="meta")  # (no bytes)
            self.current["hf"], self.current["sent"] = hf, t
            yield hf, t
        self.current["hf"], self.current["sent"] = None, None

    def undo(self) -> None:
        for param in self._swapped:
            kept = param.__dict__.pop("_th_loader", None)
            if kept is not None:
                if kept[1]:
                    param.weight_loader = kept[0]
                else:
                    param.__dict__.pop("weight_loader", None)
        self._swapped.clear()


def plan(calls: list, layers: dict, raws: dict, tensors: dict, mode_of) -> tuple[dict, dict, dict, set]:
    """(``{path: LayerPlan}``, ``{class: mode}``, ``{class: problem}``, HF names loaded)
    from the recorded ``calls``; ``layers``: {path: module}; ``raws``: {path: {param name:
    raw parameter (its shape, class, loader attributes)}}; ``mode_of(layer)``: its mode."""
    from .boxes import intersect

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
        mode = mode_of(layer)
        params = {name: ParamPlan(tuple(meta.shape), meta.dtype, slots.get((path, name), [])) for name, meta in per.items()}
        out[path] = LayerPlan(path, mode, params)
        for name in per:
            classes[f"{type(layer).__name__}.{name}"] = mode
    return out, classes, problems, seen


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

