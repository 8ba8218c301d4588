"""Flat layouts: a state_dict ⇄ a manifest's chunks ⇄ addresses in our memory.

Protocol. ``lay_out`` (publisher) cuts a state_dict into a ``Manifest``: tensors of at
least ``small_bytes`` are chunked where they lie (never copied), each starting a new
chunk so that a chunk never spans two of them; smaller tensors are copied once into
one staging buffer, chunked as a whole. ``place`` (reader) maps any manifest onto a
destination state_dict: a chunk that lies inside one tensor is read straight into it;
a chunk that spans tensors lands in a staging buffer and is scattered into them once
verified (``Placed.finish``). Both return a ``Placed``: per chunk, its address in our
memory, plus the regions an engine must register. The memory stays valid while the
``Placed`` (which keeps every tensor alive) does.
"""

from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass, field

import xxhash

from ..engines.base import Region
from ..hub import protocol as p

CHUNK_BYTES = 16 << 20
SMALL_BYTES = 1 << 20


class LayoutError(ValueError):
    """The state_dict does not fit: ``problems`` lists every mismatch, one per line."""

    def __init__(self, what: str, problems: list[str]):
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__(f"{what}:\n  " + "\n  ".join(shown))
        self.problems = problems


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def _device(t) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else -1


def _bytes(t):
    """The tensor's memory as a flat uint8 tensor (a view: same memory)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def checksum(view) -> int:
    """XXH3-64 of a flat uint8 tensor; device memory is hashed from a host copy."""
    return xxhash.xxh3_64_intdigest((view if view.device.type == "cpu" else view.cpu()).numpy())


def _system_xxh3():
    """The system's libxxhash through ctypes, which releases the GIL for the call, so
    verifier threads hash on other cores while the fetch loop moves bytes (the
    python-xxhash binding holds the GIL). Same function, same digests; None when the
    library is absent."""
    try:
        fn = ctypes.CDLL("libxxhash.so.0").XXH3_64bits
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    return fn


_XXH3 = _system_xxh3()


def checksum_unlocked(view) -> int:
    """``checksum``, without holding the GIL where the system library allows it."""
    if _XXH3 is None or view.device.type != "cpu":
        return checksum(view)
    return _XXH3(view.data_ptr(), view.nbytes)


@dataclass
class Placed:
    views: list  # per chunk of this layout: a flat uint8 tensor over its bytes in our memory
    regions: list[Region]
    device: int = -1
    scatter: dict[int, list[tuple[object, int, int, int]]] = field(default_factory=dict)
    keep: list = field(default_factory=list)  # tensors the regions point into

    def addr(self, chunk: int) -> int:
        return self.views[chunk].data_ptr()

    def checksum(self, chunk: int) -> int:
        return checksum_unlocked(self.views[chunk])

    def finish(self, chunk: int) -> None:
        """A verified staged chunk: copy its bytes into the destination tensors."""
        for dst, dst_off, src, n in self.scatter.get(chunk, ()):
            dst[dst_off:dst_off + n].copy_(src[:n])


def _check_tensors(state_dict: dict) -> tuple[list[str], int]:
    import torch

    problems, devices = [], set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(t).__name__})")
            continue
        if not t.is_contiguous():
            problems.append(f"{name}: not contiguous (call .contiguous() first: registration needs one span)")
        if t.device.type not in ("cpu", "cuda"):
            problems.append(f"{name}: device {t.device} (only cpu and cuda memory register)")
        devices.add(_device(t))
    if len(devices) > 1:
        problems.append(f"tensors live on several devices {sorted(devices)}; publish one device per endpoint")
    return problems, devices.pop() if devices else -1


def lay_out(state_dict: dict, chunk_bytes: int = CHUNK_BYTES, small_bytes: int = SMALL_BYTES
            ) -> tuple[p.Manifest, Placed]:
    import torch

    problems, device = _check_tensors(state_dict)
    if not state_dict:
        problems.append("the state_dict is empty")
    if problems:
        raise LayoutError("cannot publish this state_dict", problems)
    small = {n: t for n, t in state_dict.items() if t.nbytes < small_bytes}
    big = {n: t for n, t in state_dict.items() if t.nbytes >= small_bytes}
    metas: dict[str, p.TensorMeta] = {}
    placed = Placed(views=[], regions=[], device=device)
    offset = 0
    if small:
        dev = "cpu" if device < 0 else f"cuda:{device}"
        staging = torch.empty(sum(t.nbytes for t in small.values()), dtype=torch.uint8, device=dev)
        for name, t in small.items():
            staging[offset:offset + t.nbytes].copy_(_bytes(t))
            metas[name] = p.TensorMeta(name=name, dtype=dtype_name(t), shape=list(t.shape), nbytes=t.nbytes, offset=offset)
            offset += t.nbytes
        _add_span(placed, staging, offset, chunk_bytes)
    for name, t in big.items():
        metas[name] = p.TensorMeta(name=name, dtype=dtype_name(t), shape=list(t.shape), nbytes=t.nbytes, offset=offset)
        _add_span(placed, t, t.nbytes, chunk_bytes)
        offset += t.nbytes
    chunks = [p.ChunkMeta(nbytes=v.nbytes, checksum=checksum(v)) for v in placed.views]
    manifest = p.Manifest(tensors=[metas[n] for n in state_dict], chunks=chunks, chunk_bytes=chunk_bytes)
    return manifest, placed


def _add_span(placed: Placed, t, nbytes: int, chunk_bytes: int) -> None:
    if nbytes == 0:
        return
    flat = _bytes(t)
    placed.regions.append(Region(flat.data_ptr(), nbytes, placed.device))
    placed.keep.append(t)
    for start in range(0, nbytes, chunk_bytes):
        placed.views.append(flat[start:start + chunk_bytes])


def check_destination(shards: list[p.Manifest], into: dict) -> list[str]:
    """Every way ``into`` differs from the manifest (empty: it fits)."""
    import torch

    want: dict[str, p.TensorMeta] = {}
    problems = []
    for rank, m in enumerate(shards):
        for t in m.tensors:
            if t.name in want:
                problems.append(f"{t.name}: appears in two shards (rank {rank} and an earlier one)")
            want[t.name] = t
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
        problems += _check_tensors(into)[0]
    return problems


def place(shards: list[p.Manifest], into: dict) -> Placed:
    """Map the global chunks of ``shards`` (rank 0's first) onto ``into``'s memory."""
    import torch

    problems = check_destination(shards, into)
    if problems:
        raise LayoutError("the destination does not match the manifest; nothing was written", problems)
    first = next(iter(into.values()), None)
    device = _device(first) if first is not None else -1  # checked above: one device for all
    placed = Placed(views=[], regions=[], device=device)
    staged: list[tuple[int, int, int, p.Manifest]] = []  # (global chunk, start, end, shard)
    for m in shards:
        tensors = sorted((t for t in m.tensors if t.nbytes), key=lambda t: t.offset)
        starts = [t.offset for t in tensors]
        start = 0
        for c in m.chunks:
            end = start + c.nbytes
            i = bisect.bisect_right(starts, start) - 1
            t = tensors[i] if i >= 0 else None
            if t is not None and t.offset <= start and end <= t.offset + t.nbytes:
                placed.views.append(_bytes(into[t.name])[start - t.offset:end - t.offset])
            else:
                placed.views.append(None)  # filled below, once the staging buffer exists
                staged.append((len(placed.views) - 1, start, end, m))
            start = end
    used = {name for name, t in into.items() if t.nbytes}
    for name in used:
        placed.regions.append(Region(into[name].data_ptr(), into[name].nbytes, device))
        placed.keep.append(into[name])
    if staged:
        dev = "cpu" if device < 0 else f"cuda:{device}"
        staging = torch.empty(sum(e - s for _, s, e, _ in staged), dtype=torch.uint8, device=dev)
        placed.regions.append(Region(staging.data_ptr(), staging.nbytes, device))
        placed.keep.append(staging)
        at = 0
        for chunk, start, end, m in staged:
            placed.views[chunk] = staging[at:at + end - start]
            placed.scatter[chunk] = _pieces(m, start, end, placed.views[chunk], into)
            at += end - start
    return placed


def _spans(m: p.Manifest, start: int, end: int):
    """(tensor, lo, hi): the bytes [lo, hi) of the flat layout that each tensor has
    inside the chunk [start, end), in layout order."""
    for t in m.tensors:
        lo, hi = max(start, t.offset), min(end, t.offset + t.nbytes)
        if lo < hi:
            yield t, lo, hi


def _pieces(m: p.Manifest, start: int, end: int, src, into: dict) -> list:
    return [(_bytes(into[t.name]), lo - t.offset, src[lo - start:], hi - lo) for t, lo, hi in _spans(m, start, end)]


def verify(shards: list[p.Manifest], into: dict) -> list[str]:
    """Re-hash ``into``'s tensors chunk by chunk against the manifest (empty: every
    byte is the version's). Reads the destination itself, not the staging copies a
    fetch verified, so it also catches bytes changed after the fetch."""
    import torch

    problems = check_destination(shards, into)
    if problems:
        return problems
    for rank, m in enumerate(shards):
        start = 0
        for i, c in enumerate(m.chunks):
            end = start + c.nbytes
            pieces = [(t.name, _bytes(into[t.name])[lo - t.offset:hi - t.offset]) for t, lo, hi in _spans(m, start, end)]
            flat = pieces[0][1] if len(pieces) == 1 else torch.cat([b.cpu() for _, b in pieces])
            if checksum(flat) != c.checksum:
                names = ", ".join(n for n, _ in pieces[:3]) + (" …" if len(pieces) > 3 else "")
                problems.append(f"shard {rank} chunk {i} ({names}): checksum differs from the manifest")
            start = end
    return problems


def allocate(shards: list[p.Manifest], device: str = "cpu") -> dict:
    """Fresh tensors matching the manifest: a destination for a copy nobody supplied
    (the agent's host-tier retention copies, ``th sync`` into an agent)."""
    import torch

    return {t.name: torch.empty(t.shape, dtype=getattr(torch, t.dtype), device=device)
            for m in shards for t in m.tensors}
