"""Publisher side: cut a state_dict into a manifest's chunks, where the tensors lie.

Protocol. ``lay_out(state_dict, chunk_bytes, small_bytes, digest=None)`` returns the
``Manifest`` (tensors in the state_dict's order, each chunk's size, checksum and digest
kind) and the ``Placed`` to register. A value is a tensor (the whole global tensor) or
a ``targets.Part`` (a box of one: a DTensor's local shard, a TP slice); the manifest
records each piece's global shape and box (contract 9). Tensors of at least
``small_bytes`` are chunked where they lie (never copied), each starting a new chunk so
that a chunk never spans two of them, and cut at row boundaries (a row: the last
dimension) so a chunk is a block of whole rows; smaller tensors are copied once into one
staging buffer, laid out first and chunked as a whole. Checksums are taken where the
tensors lie: ``digest=None`` picks the kind from their device (``digest_for``: dev64 on
a GPU, no host copy; XXH3 on the host); naming a kind forces it (tests hash CPU tensors
as dev64). A chunk of whole rows is hashed again as tiles (``tiles``): a reader of
another layout reads and verifies the tiles its box needs, not the chunk. The caller
must not change the big tensors while the manifest is published: their checksums were
taken here. Raises ``LayoutError`` (nothing copied) when a tensor cannot register or
``digest`` names no kind.
"""

from __future__ import annotations

from math import prod

from ..engines.base import Region
from ..hub import protocol as p
from .checksum import DIGESTS, digest_for
from .checksum import digest as digest_of
from .placed import Placed
from .targets import Part
from .tensors import LayoutError, check_tensors, dtype_name, flat_bytes

CHUNK_BYTES = 16 << 20
SMALL_BYTES = 1 << 20
# A tile is about this big: the rounding a reader of another layout pays at each edge
# of its box, and one digest per tile in the manifest (64 per 16 MiB chunk).
TILE_BYTES = 256 << 10
# A column strip is at least this wide: narrower ones cost a descriptor per row for
# little saving.
MIN_STRIP_BYTES = 64
STRIPS = (8, 4, 2)


def rows_of(shape) -> tuple[int, int]:
    """(rows, elements per row) of a row-major tensor: a row is the last dimension (a
    1-D tensor's rows are single elements)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return prod(shape[:-1]), shape[-1]


def lay_out(state_dict: dict, chunk_bytes: int = CHUNK_BYTES, small_bytes: int = SMALL_BYTES,
            digest: str | None = None, tile_bytes: int = TILE_BYTES) -> tuple[p.Manifest, Placed]:
    import torch

    tensors = {n: (v.tensor if isinstance(v, Part) else v) for n, v in state_dict.items()}
    problems, device = check_tensors(tensors)
    problems += _check_parts(state_dict)
    if not state_dict:
        problems.append("the state_dict is empty")
    if digest is not None and digest not in DIGESTS:
        problems.append(f"digest: {digest!r} is not one of {', '.join(DIGESTS)}")
    if problems:
        raise LayoutError("cannot publish this state_dict", problems)
    kind = digest or digest_for(device)
    small = {n: t for n, t in tensors.items() if t.nbytes < small_bytes}
    big = {n: t for n, t in tensors.items() if t.nbytes >= small_bytes}
    metas: dict[str, p.TensorMeta] = {}
    placed = Placed(views=[], regions=[], device=device)
    chunks: list[p.ChunkMeta] = []
    offset = 0
    if small:
        dev = "cpu" if device < 0 else f"cuda:{device}"
        staging = torch.empty(sum(t.nbytes for t in small.values()), dtype=torch.uint8, device=dev)
        for name, t in small.items():
            staging[offset:offset + t.nbytes].copy_(flat_bytes(t))
            metas[name] = _meta(name, state_dict[name], offset)
            offset += t.nbytes
        _register(placed, staging, offset)
        for start in range(0, offset, chunk_bytes):
            view = flat_bytes(staging)[start:start + chunk_bytes]
            placed.views.append(view)
            chunks.append(p.ChunkMeta(nbytes=view.nbytes, checksum=digest_of(view, kind), digest=kind))
    for name, t in big.items():
        metas[name] = _meta(name, state_dict[name], offset)
        _register(placed, t, t.nbytes)
        for view, rows, row_bytes in _row_chunks(t, chunk_bytes):
            meta = p.ChunkMeta(nbytes=view.nbytes, checksum=digest_of(view, kind), digest=kind)
            if rows:
                _tile(meta, view, rows, row_bytes, t.element_size(), kind, tile_bytes)
            placed.views.append(view)
            chunks.append(meta)
        offset += t.nbytes
    placed.digests = [kind] * len(placed.views)
    manifest = p.Manifest(tensors=[metas[n] for n in state_dict], chunks=chunks, chunk_bytes=chunk_bytes)
    return manifest, placed


def _check_parts(state_dict: dict) -> list[str]:
    problems = []
    for name, v in state_dict.items():
        if not isinstance(v, Part):
            continue
        shape, g, at = tuple(v.tensor.shape), tuple(v.global_shape), tuple(v.offsets)
        if len(g) != len(shape) or len(at) != len(shape):
            problems.append(f"{name}: a piece of shape {list(shape)} cannot be a box of global shape {list(g)} "
                            f"at {list(at)} (dimensions differ)")
        elif any(o < 0 or o + s > n for o, s, n in zip(at, shape, g)):
            problems.append(f"{name}: the box at {list(at)} of size {list(shape)} lies outside the global shape {list(g)}")
    return problems


def _meta(name: str, value, offset: int) -> p.TensorMeta:
    t = value.tensor if isinstance(value, Part) else value
    meta = p.TensorMeta(name=name, dtype=dtype_name(t), shape=list(t.shape), nbytes=t.nbytes, offset=offset)
    if isinstance(value, Part) and (tuple(value.global_shape) != tuple(t.shape) or any(value.offsets)):
        meta.global_shape, meta.box_offsets = list(value.global_shape), list(value.offsets)
    return meta


def _register(placed: Placed, t, nbytes: int) -> None:
    if nbytes == 0:
        return
    flat = flat_bytes(t)
    placed.regions.append(Region(flat.data_ptr(), nbytes, placed.device))
    placed.keep.append(t)


def _row_chunks(t, chunk_bytes: int):
    """(view, rows, row_bytes) per chunk of ``t``: blocks of whole rows when a row fits
    a chunk (rows = 0 when it does not: plain byte ranges, verified whole)."""
    flat = flat_bytes(t)
    _, per_row = rows_of(tuple(t.shape))
    row_bytes = per_row * t.element_size()
    step = chunk_bytes // row_bytes * row_bytes if 0 < row_bytes <= chunk_bytes else chunk_bytes
    for start in range(0, t.nbytes, step):
        view = flat[start:start + step]
        yield view, (view.nbytes // row_bytes if row_bytes <= chunk_bytes else 0), row_bytes


def strips_for(per_row: int, row_bytes: int) -> int:
    """Equal column strips of a row: the widest split among ``STRIPS`` (8 fits TP 1, 2,
    4 and 8) whose strips stay at least ``MIN_STRIP_BYTES`` wide; else 1."""
    for k in STRIPS:
        if per_row % k == 0 and row_bytes // k >= MIN_STRIP_BYTES:
            return k
    return 1


def _tile(meta: p.ChunkMeta, view, rows: int, row_bytes: int, elem: int, kind: str, tile_bytes: int) -> None:
    """Hash the chunk again as tiles (row blocks x column strips), when there is more
    than one: one contiguous copy per row block, then one digest per strip."""
    strips = strips_for(row_bytes // elem, row_bytes)
    strip = row_bytes // strips
    tile_rows = max(1, tile_bytes // strip)
    if strips == 1 and tile_rows >= rows:
        return
    grid = view.view(rows, strips, strip)
    tiles = []
    for r in range(0, rows, tile_rows):
        block = grid[r:r + tile_rows].permute(1, 0, 2).contiguous()
        tiles += [digest_of(block[k].reshape(-1), kind) for k in range(strips)]
    meta.tile_rows, meta.strips, meta.tiles = min(tile_rows, rows), strips, tiles
