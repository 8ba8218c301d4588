"""Layouts as records: what a publisher registers of a global tensor, what a reader wants of it.

Protocol. A publisher's state_dict maps each global tensor's name to a plain tensor
(the whole of it) or a ``Part``: its memory ``tensor`` is the ``box`` of the global
tensor (``global_shape``) starting at ``offsets``; the sizes are ``tensor.shape``.
A reader's destination is a list of ``Target``: one registered tensor (an engine
parameter, a DTensor's local shard) and the ``Slot``s that fill it, each a box of one
global tensor landing in a view of that tensor. Fused parameters (vLLM's ``qkv_proj``)
are one target with several slots; a TP slice is one slot over part of a global tensor.
Helpers that build them: ``whole``, ``tp``, ``fused`` here; DTensors in ``dtensor``
(which builds on these records; this module knows nothing of DTensors). A fetch
destination mixing tensors, DTensors and Targets becomes targets in
``endpoint.layouts.targets``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError
from .boxes import Box, split


@dataclass(slots=True)
class Part:
    """What a publisher registers of one global tensor: ``tensor`` (contiguous) is the
    box of the global tensor that starts at ``offsets``."""

    tensor: object
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def box(self) -> Box:
        return Box(tuple(self.offsets), tuple(self.tensor.shape))


@dataclass(slots=True)
class Slot:
    """The ``box`` of global tensor ``name`` lands in ``view`` (shape == box sizes, any
    strides, inside its target's tensor). ``global_shape``: what the caller believes the
    global tensor's shape is (checked against the manifest; None: not checked)."""

    name: str
    box: Box
    view: object
    global_shape: tuple[int, ...] | None = None


@dataclass(slots=True)
class Target:
    """One registered destination tensor (contiguous) and the slots that fill it."""

    tensor: object
    slots: list[Slot]


def _check_tensor(name: str, tensor) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"{name}: cannot be a target", [f"{name}: not a tensor ({type(tensor).__name__})"])
    if not tensor.is_contiguous():
        # A target's tensor is registered as one span: a strided one has holes.
        raise LayoutError(f"{name}: cannot be a target", [f"{name}: not contiguous (call .contiguous() first)"])


def _check_split(what: str, dim: int, ndim: int, rank: int, world: int) -> None:
    problems = []
    if not isinstance(world, int) or world < 1:
        problems.append(f"world: want a positive int, got {world!r}")
    elif not isinstance(rank, int) or not 0 <= rank < world:
        problems.append(f"rank: want an int in [0, {world}), got {rank!r}")
    if not isinstance(dim, int) or not 0 <= dim < ndim:
        problems.append(f"dim: want an int in [0, {ndim}), got {dim!r}")
    if problems:
        raise LayoutError(f"{what}: bad split", problems)


def whole(name: str, tensor) -> Target:
    """The whole global tensor ``name`` lands in ``tensor`` (global shape: its shape)."""
    _check_tensor(name, tensor)
    shape = tuple(tensor.shape)
    return Target(tensor, [Slot(name, Box.whole(shape), tensor, shape)])


def tp(name: str, tensor, global_shape, dim: int, rank: int, world: int) -> Target:
    """``tensor`` is TP rank ``rank`` of ``world``'s slice of global tensor ``name``
    along ``dim`` (``boxes.split``: torch.chunk's sizes). An empty slice has no slot."""
    _check_tensor(name, tensor)
    gshape = tuple(int(s) for s in global_shape)
    _check_split(name, dim, len(gshape), rank, world)
    start, size = split(gshape[dim], world, rank)
    want = gshape[:dim] + (size,) + gshape[dim + 1:]
    if tuple(tensor.shape) != want:
        raise LayoutError(f"{name}: not rank {rank}/{world}'s slice along dim {dim}", [
            f"{name}: shape {list(tensor.shape)}, want {list(want)} (global {list(gshape)})"])
    offsets = tuple(start if d == dim else 0 for d in range(len(gshape)))
    slots = [Slot(name, Box(offsets, want), tensor, gshape)] if size else []
    return Target(tensor, slots)


def fused(tensor, parts, dim: int, rank: int, world: int) -> Target:
    """One parameter holding rank ``rank`` of ``world``'s slice of each global tensor of
    ``parts`` (``[(name, global_shape), ...]``), one after the other along ``dim``:
    vLLM's ``qkv_proj`` (q, k, v rows) and ``gate_up_proj``."""
    parts = [(n, tuple(int(s) for s in g)) for n, g in parts]
    names = ", ".join(n for n, _ in parts) or "(no parts)"
    _check_tensor(names, tensor)
    if not parts:
        raise LayoutError("fused: nothing to fuse", ["parts: empty"])
    _check_split(names, dim, tensor.dim(), rank, world)
    problems, spans, at = [], [], 0
    for name, gshape in parts:
        if len(gshape) != tensor.dim():
            problems.append(f"{name}: global shape {list(gshape)} has {len(gshape)} dims, the fused tensor {tensor.dim()}")
            continue
        others = [(d, gshape[d], tensor.shape[d]) for d in range(len(gshape)) if d != dim and gshape[d] != tensor.shape[d]]
        problems += [f"{name}: dim {d} is {g} globally but {t} in the fused tensor" for d, g, t in others]
        start, size = split(gshape[dim], world, rank)
        spans.append((name, gshape, start, size, at))
        at += size
    if not problems and at != tensor.shape[dim]:
        problems.append(f"parts {names}: rank {rank}/{world}'s slices add up to {at} along dim {dim}, "
                        f"the fused tensor has {tensor.shape[dim]} (shape {list(tensor.shape)})")
    if problems:
        raise LayoutError(f"fused {names}: parts do not fit the tensor", problems)
    slots = []
    for name, gshape, start, size, at in spans:
        if size:
            sizes = gshape[:dim] + (size,) + gshape[dim + 1:]
            offsets = tuple(start if d == dim else 0 for d in range(len(gshape)))
            slots.append(Slot(name, Box(offsets, sizes), tensor.narrow(dim, at, size), gshape))
    return Target(tensor, slots)
