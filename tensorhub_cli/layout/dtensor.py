"""DTensors as layouts: the box of the global tensor that this rank's local shard is.

Protocol.

- ``target(name, dt)`` (reader) → the ``Target`` that fills ``dt``'s local tensor:
  one slot, the box its local shard covers in the global tensor. Over Replicate mesh
  dims every rank reads its full local copy (each replica is a destination).
- ``parts(state_dict)`` (publisher) → ``(state_dict', (rank, world) | None)``: plain
  tensors pass through; a DTensor becomes a ``Part`` of its local tensor, except that
  a box several ranks hold (they differ only in Replicate mesh dims) is published
  once: those replicas split it along its dim 0 (``boxes.split``, replica index = the
  rank's row-major coordinate over the Replicate mesh dims), each publishing its
  rows in place (a view, no copy); a rank whose share is empty leaves the tensor out.
  ``(rank, world)`` is this rank's row-major coordinate in the mesh and the mesh's
  size (every DTensor must share one mesh); None when there is no DTensor.

Refused with ``LayoutError`` (nothing returned): Partial placements (a partial sum is
not yet a tensor), any placement but Shard and Replicate (a strided shard, FSDP2 + TP
on one dim, holds rows that are not one box), non-contiguous local tensors (registration needs one span), a rank outside the
mesh, DTensors on different meshes.
"""

from __future__ import annotations

from ..errors import LayoutError
from .boxes import Box, split
from .targets import Part, Slot, Target


def _local_box(name: str, dt) -> tuple[object, Box]:
    """``dt``'s local tensor and the box of the global tensor it holds."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    # Private, but it is what torch.distributed.checkpoint itself uses to place a
    # local shard in the global tensor (uneven shards and multi-dim meshes included).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    problems = []
    for i, pl in enumerate(dt.placements):
        if isinstance(pl, Partial):
            problems.append(f"{name}: mesh dim {i} is {pl!r} (a partial sum is not a tensor yet: reduce it first)")
        # An allow-list, not a deny-list: a strided shard (FSDP2 + TP on one dim; not a
        # Shard subclass in every torch) or a future placement need not be one box.
        elif not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and not hasattr(pl, "split_factor"))):
            problems.append(f"{name}: mesh dim {i} is {pl!r} (only Shard and Replicate lay out as one box)")
    local = dt.to_local()
    if not local.is_contiguous():
        problems.append(f"{name}: local tensor is not contiguous (registration needs one span)")
    if dt.device_mesh.get_coordinate() is None:
        problems.append(f"{name}: this rank is not in the DTensor's mesh")
    if problems:
        raise LayoutError(f"{name}: cannot lay out this DTensor", problems)
    shape, offsets = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if tuple(shape) != tuple(local.shape):  # torch's own invariant; a mismatch would misplace bytes
        raise LayoutError(f"{name}: cannot lay out this DTensor", [
            f"{name}: local shape {list(local.shape)}, its placements imply {list(shape)}"])
    return local, Box(tuple(offsets), tuple(shape))


def target(name: str, dt) -> Target:
    """The target filling ``dt``'s local tensor with its box of global tensor ``name``."""
    local, box = _local_box(name, dt)
    slots = [Slot(name, box, local, tuple(dt.shape))] if box.volume else []
    return Target(local, slots)


def _replica(dt) -> tuple[int, int]:
    """(index, count) of this rank among the ranks holding the same local box: its
    row-major coordinate over the Replicate mesh dims."""
    from torch.distributed.tensor import Replicate

    coord, sizes = dt.device_mesh.get_coordinate(), dt.device_mesh.shape
    index, count = 0, 1
    for d, pl in enumerate(dt.placements):
        if isinstance(pl, Replicate):
            index, count = index * sizes[d] + coord[d], count * sizes[d]
    return index, count


def parts(state_dict: dict) -> tuple[dict, tuple[int, int] | None]:
    """What this rank publishes of ``state_dict`` and its (rank, world) in the mesh."""
    from torch.distributed.tensor import DTensor

    out, problems, mesh, first = {}, [], None, None
    for name, value in state_dict.items():
        if not isinstance(value, DTensor):
            out[name] = value
            continue
        if mesh is None:
            mesh, first = value.device_mesh, name
        elif value.device_mesh != mesh:
            problems.append(f"{name}: on mesh {value.device_mesh}, but {first} is on {mesh} (publish one mesh at a time)")
            continue
        try:
            local, box = _local_box(name, value)
        except LayoutError as e:
            problems += e.problems
            continue
        index, count = _replica(value)
        if local.dim() == 0:  # a scalar cannot be split: the first replica publishes it
            start, size = (0, 1) if index == 0 else (0, 0)
        else:
            start, size = split(local.shape[0], count, index)
        if size == 0 or box.volume == 0:
            continue
        offsets = list(box.offsets)
        if local.dim():
            offsets[0] += start
            local = local[start:start + size]  # rows of a contiguous tensor: still contiguous, a view
        out[name] = Part(local, tuple(value.shape), tuple(offsets))
    if problems:
        raise LayoutError("cannot publish these DTensors", problems)
    if mesh is None:
        return out, None
    rank = 0
    for c, s in zip(mesh.get_coordinate(), mesh.shape):
        rank = rank * s + c
    return out, (rank, mesh.size())
