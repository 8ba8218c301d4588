"""Reader side: map a manifest onto a destination state_dict, and check one against it.

Protocol.

- ``check_destination(shards, into)`` → every way ``into`` differs from the manifest
  (names, dtypes, shapes, contiguity, one device); empty: it fits. Reads nothing.
- ``place(shards, into)`` → a ``Placed`` over the global chunks of ``shards`` (rank
  0's first). A chunk inside one tensor is read straight into it; a chunk that spans
  tensors lands in a staging buffer and reaches them by ``Placed.finish``. Raises
  ``LayoutError`` with ``into`` untouched when it does not fit.
- ``verify(shards, into)`` → problems, re-hashing ``into`` itself chunk by chunk
  with each chunk's digest kind, on ``into``'s own device (empty: byte for byte the
  version). Reads only.
- ``allocate(shards, device)`` → fresh tensors matching the manifest.

Keys: each piece of the version is one destination tensor, named by ``piece_keys``:
its tensor's name, or ``name#rank`` where the name has pieces in several shards (a
version published in boxes, held here as its publishers laid it out: an agent's
retention copy). A destination in another layout goes through ``overlap``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..engines.base import Region
from ..hub import protocol as p
from .checksum import digest
from .placed import Piece, Placed
from .tensors import LayoutError, check_tensors, device_of, dtype_name, flat_bytes


@dataclass(slots=True)
class _Staged:
    chunk: int  # global chunk id
    start: int  # the chunk's bytes [start, end) in its shard's flat layout
    end: int
    shard: p.Manifest


def piece_keys(shards: list[p.Manifest]) -> dict[int, str]:
    """id(TensorMeta) -> the destination key of that piece (see the module docstring)."""
    count: dict[str, int] = {}
    for m in shards:
        for t in m.tensors:
            count[t.name] = count.get(t.name, 0) + 1
    return {id(t): t.name if count[t.name] == 1 else f"{t.name}#{rank}"
            for rank, m in enumerate(shards) for t in m.tensors}


def check_destination(shards: list[p.Manifest], into: dict) -> list[str]:
    """Every way ``into`` differs from the manifest (empty: it fits)."""
    import torch

    keys = piece_keys(shards)
    want: dict[str, p.TensorMeta] = {}
    problems = []
    for rank, m in enumerate(shards):
        for t in m.tensors:
            if keys[id(t)] in want:
                problems.append(f"{t.name}: appears twice in shard {rank}")
            want[keys[id(t)]] = t
    for name in sorted(want.keys() - into.keys()):
        problems.append(f"{name}: missing from the destination")
    for name in sorted(into.keys() - want.keys()):
        problems.append(f"{name}: not in the manifest")
    for name in sorted(want.keys() & into.keys()):
        meta, t = want[name], into[name]
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(t).__name__})")
            continue
        if dtype_name(t) != meta.dtype:
            problems.append(f"{name}: dtype {dtype_name(t)}, manifest has {meta.dtype}")
        if list(t.shape) != meta.shape:
            problems.append(f"{name}: shape {list(t.shape)}, manifest has {meta.shape}")
        if not t.is_contiguous():
            problems.append(f"{name}: not contiguous")
    if not problems:
        problems += check_tensors(into)[0]
    return problems


def place(shards: list[p.Manifest], into: dict) -> Placed:
    """Map the global chunks of ``shards`` (rank 0's first) onto ``into``'s memory."""
    import torch

    problems = check_destination(shards, into)
    if problems:
        raise LayoutError("the destination does not match the manifest; nothing was written", problems)
    first = next(iter(into.values()), None)
    device = device_of(first) if first is not None else -1  # checked above: one device for all
    placed = Placed(views=[], regions=[], device=device)
    keys = piece_keys(shards)
    staged: list[_Staged] = []
    for m in shards:
        tensors = sorted((t for t in m.tensors if t.nbytes), key=lambda t: t.offset)
        starts = [t.offset for t in tensors]
        start = 0
        for c in m.chunks:
            end = start + c.nbytes
            i = bisect.bisect_right(starts, start) - 1
            t = tensors[i] if i >= 0 else None
            if t is not None and t.offset <= start and end <= t.offset + t.nbytes:
                placed.views.append(flat_bytes(into[keys[id(t)]])[start - t.offset:end - t.offset])
            else:
                placed.views.append(None)  # filled below, once the staging buffer exists
                staged.append(_Staged(len(placed.views) - 1, start, end, m))
            placed.digests.append(c.digest)
            start = end
    used = {name for name, t in into.items() if t.nbytes}
    for name in used:
        placed.regions.append(Region(into[name].data_ptr(), into[name].nbytes, device))
        placed.keep.append(into[name])
    if staged:
        dev = "cpu" if device < 0 else f"cuda:{device}"
        staging = torch.empty(sum(s.end - s.start for s in staged), dtype=torch.uint8, device=dev)
        placed.regions.append(Region(staging.data_ptr(), staging.nbytes, device))
        placed.keep.append(staging)
        at = 0
        for s in staged:
            placed.views[s.chunk] = staging[at:at + s.end - s.start]
            placed.scatter[s.chunk] = _pieces(s.shard, s.start, s.end, placed.views[s.chunk], into, keys)
            at += s.end - s.start
    return placed


def _spans(m: p.Manifest, start: int, end: int):
    """(tensor, lo, hi): the bytes [lo, hi) of the flat layout that each tensor has
    inside the chunk [start, end), in layout order."""
    for t in m.tensors:
        lo, hi = max(start, t.offset), min(end, t.offset + t.nbytes)
        if lo < hi:
            yield t, lo, hi


def _pieces(m: p.Manifest, start: int, end: int, src, into: dict, keys: dict[int, str]) -> list[Piece]:
    return [Piece(flat_bytes(into[keys[id(t)]]), lo - t.offset, src[lo - start:], hi - lo)
            for t, lo, hi in _spans(m, start, end)]


def verify(shards: list[p.Manifest], into: dict) -> list[str]:
    """Re-hash ``into``'s tensors chunk by chunk against the manifest (empty: every
    byte is the version's). Reads the destination itself, not the staging copies a
    fetch verified, so it also catches bytes changed after the fetch."""
    import torch

    problems = check_destination(shards, into)
    if problems:
        return problems
    keys = piece_keys(shards)
    for rank, m in enumerate(shards):
        start = 0
        for i, c in enumerate(m.chunks):
            end = start + c.nbytes
            pieces = [(t.name, flat_bytes(into[keys[id(t)]])[lo - t.offset:hi - t.offset])
                      for t, lo, hi in _spans(m, start, end)]
            # Joined where they lie: a dev64 chunk is hashed on its own device.
            flat = pieces[0][1] if len(pieces) == 1 else torch.cat([b for _, b in pieces])
            if digest(flat, c.digest) != c.checksum:
                names = ", ".join(n for n, _ in pieces[:3]) + (" …" if len(pieces) > 3 else "")
                problems.append(f"shard {rank} chunk {i} ({names}): checksum differs from the manifest")
            start = end
    return problems


def allocate(shards: list[p.Manifest], device: str = "cpu") -> dict:
    """Fresh tensors matching the manifest: a destination for a copy nobody supplied
    (the agent's host-tier retention copies, ``th sync`` into an agent)."""
    import torch

    keys = piece_keys(shards)
    return {keys[id(t)]: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
            for m in shards for t in m.tensors}
