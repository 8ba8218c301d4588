"""DTensors as layouts: the box of the global tensor that this rank's local shard is.

Protocol.

- ``target(name, dt)`` (reader) → the ``Target`` that fills ``dt``'s local tensor:
  one slot, the box its local shard covers in the global tensor. Over Replicate mesh
  dims every rank reads its full local copy (each replica is a destination).
- ``parts(state_dict)`` (publisher) → ``(state_dict', (rank, world) | None)``: a
  DTensor becomes a ``Part`` of its local tensor, except that a box several ranks hold
  (they differ only in Replicate mesh dims) is published once: those replicas split it
  along its dim 0 (``boxes.split``, replica index = the rank's row-major coordinate
  over the Replicate mesh dims), each publishing its rows in place (a view, no copy);
  a rank whose share is empty leaves the tensor out. A plain tensor beside DTensors
  (a buffer FSDP2 leaves unsharded: rotary ``inv_freq``, a norm's buffer) is published
  whole by mesh rank 0 alone: its bytes are one rank's, never rows of several (plain
  tensors carry no promise that ranks agree), and the ranks' boxes cover it once.
  ``Part``s pass through (their box is the caller's), and so does everything when
  there is no DTensor. ``(rank, world)`` is this rank's row-major coordinate in the
  mesh and the mesh's size (every DTensor must share one mesh); None when there is
  no DTensor.

Refused with ``LayoutError`` (nothing returned): Partial placements (a partial sum is
not yet a tensor), any placement but Shard and Replicate (a strided shard, FSDP2 + TP
on one dim, holds rows that are not one box), non-contiguous local tensors
(registration needs one span), a rank outside the mesh, DTensors on different meshes.
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
    import torch
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
            part = _published_part(name, value)
        except LayoutError as e:
            problems += e.problems
            continue
        if part is not None:
            out[name] = part
    if problems:
        raise LayoutError("cannot publish these DTensors", problems)
    if mesh is None:
        return out, None
    rank = _mesh_rank(mesh)
    if rank:  # plain tensors are mesh rank 0's to publish (see the module's protocol)
        out = {n: v for n, v in out.items() if not isinstance(v, torch.Tensor)}  # Parts stay: their box is given
    return out, (rank, mesh.size())


def _published_part(name: str, dt):
    """The ``Part`` of ``dt`` this rank publishes, or None (its share is empty)."""
    local, box = _local_box(name, dt)
    index, count = _replica(dt)
    if local.dim() == 0:  # a scalar cannot be split: the first replica publishes it
        start, size = (0, 1) if index == 0 else (0, 0)
    else:
        start, size = split(local.shape[0], count, index)
    if size == 0 or box.volume == 0:
        return None
    offsets = list(box.offsets)
    if local.dim():
        offsets[0] += start
        local = local[start:start + size]  # rows of a contiguous tensor: still contiguous, a view
    return Part(local, tuple(dt.shape), tuple(offsets))


def _mesh_rank(mesh) -> int:
    """This rank's row-major coordinate in ``mesh``."""
    rank = 0
    for c, s in zip(mesh.get_coordinate(), mesh.shape):
        rank = rank * s + c
    return rank
