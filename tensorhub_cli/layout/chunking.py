"""Publisher side: cut a state_dict into a manifest's chunks, where the tensors lie.

Protocol. ``lay_out(state_dict, chunk_bytes, small_bytes, digest=None)`` returns the
``Manifest`` (tensors in the state_dict's order, each chunk's size, checksum and digest
kind) and the ``Placed`` to register. A value is a tensor (the whole global tensor) or
a ``targets.Part`` (a box of one: a DTensor's local shard, a TP slice); the manifest
records each piece's global shape and box (contract 9). Tensors are chunked where they
lie (never copied), each starting a new chunk so that a chunk never spans two of them,
and cut at row boundaries (a row: the last dimension) so a chunk is a block of whole
rows; only *compact* tensors are copied once into one staging buffer, laid out first
and chunked as a whole: those below ``small_bytes`` that a reader of another layout
takes whole anyway (0-D and 1-D: norms, biases, scalars) or that are below one tile
(``tile_bytes``). A 2-D tensor of a tile or more is never packed with others: a TP
reader reads its part of it, not a shared chunk whole. Checksums are taken where the
tensors lie: ``digest=None`` picks the kind from their device (``digest_for``: dev64 on
a GPU, no host copy; XXH3 on the host); naming a kind forces it (tests hash CPU tensors
as dev64). A chunk of whole rows is hashed again as tiles (``tiles``): a reader of
another layout reads and verifies the tiles its box needs, not the chunk. The tile
grid (``grid_for``) is cut so that a TP reader of either dimension reads exactly its
part: ``strips`` equal column strips (8, 4 or 2: TP 8, 4, 2 split the columns on strip
edges) by row blocks of ``tile_rows`` rows, a power of two that divides the tensor's
TP segment (its rows over 8, 4 or 2) where it can, so a TP split of the rows falls on
block edges too; chunks hold a whole number of row blocks. The caller must not change
the big tensors while the manifest is published: their checksums were taken here.
Raises ``LayoutError`` (nothing copied) when a tensor cannot register or ``digest``
names no kind.
"""

from __future__ import annotations

from dataclasses import dataclass
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
# A chunk holds at most this many tiles (a digest each in the manifest): the floor on a
# row block where a tensor's TP segment has few factors of two (an odd vocabulary).
MAX_TILES = 512


@dataclass(frozen=True, slots=True)
class Grid:
    """How a tensor is cut: ``step`` rows per chunk (0: a row is bigger than a chunk,
    cut in plain byte ranges, no tiles), tiles of ``tile_rows`` rows by ``strips``."""

    step: int
    tile_rows: int
    strips: int


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
    small = {n: t for n, t in tensors.items() if compact(tuple(t.shape), t.nbytes, small_bytes, tile_bytes)}
    big = {n: t for n, t in tensors.items() if n not in small}
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
        grid = grid_for(tuple(t.shape), t.element_size(), chunk_bytes, tile_bytes)
        for view, rows, row_bytes in _row_chunks(t, chunk_bytes, grid):
            meta = p.ChunkMeta(nbytes=view.nbytes, checksum=digest_of(view, kind), digest=kind)
            if rows:
                _tile(meta, view, rows, row_bytes, grid, kind)
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


def compact(shape: tuple, nbytes: int, small_bytes: int, tile_bytes: int) -> bool:
    """Packed with the other compact tensors into shared chunks: below ``small_bytes``,
    and either 0-D/1-D (a norm, a bias: a reader of another layout takes it whole or
    nearly) or smaller than one tile (its part of it would be all rounding)."""
    return nbytes < small_bytes and (len(shape) <= 1 or nbytes < tile_bytes)


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def grid_for(shape: tuple, elem: int, chunk_bytes: int = CHUNK_BYTES, tile_bytes: int = TILE_BYTES) -> Grid:
    """The chunks and tiles of a tensor of ``shape``. TP splits a tensor's rows or its
    columns into 2, 4 or 8 equal parts: the columns on strip edges (``strips_for``),
    the rows on multiples of the *segment* (rows over the largest of 8, 4, 2 dividing
    them). A row block is the largest power of two that divides the segment, no more
    rows than a tile of ``tile_bytes`` holds; so every TP edge is a block edge and a
    TP reader reads exactly its part. Where the segment has few factors of two (an odd
    vocabulary) the block is at least what keeps a chunk at ``MAX_TILES`` tiles: the
    rounding is then under one block per edge. A chunk is the most whole row blocks
    that fit ``chunk_bytes``: the chunk count of a model whose rows are multiples of
    a tile's (every real one) is what whole-row chunks gave."""
    rows, per_row = rows_of(shape)
    row_bytes = per_row * elem
    if row_bytes == 0 or row_bytes > chunk_bytes:
        return Grid(0, 0, 1)
    strips = strips_for(per_row, row_bytes)
    chunk_rows = chunk_bytes // row_bytes
    cap = min(_pow2_floor(tile_bytes // (row_bytes // strips)), _pow2_floor(chunk_rows))
    parts = next((k for k in STRIPS if rows % k == 0), 1)
    segment = rows // parts
    aligned = segment & -segment if segment else cap
    floor = _pow2_ceil(-(-min(rows, chunk_rows) * strips // MAX_TILES))
    tile_rows = min(cap, max(aligned, floor))
    return Grid(chunk_rows // tile_rows * tile_rows, tile_rows, strips)


def _row_chunks(t, chunk_bytes: int, grid: Grid):
    """(view, rows, row_bytes) per chunk of ``t``: ``grid.step`` whole rows (rows = 0
    when a row does not fit a chunk: plain byte ranges, verified whole)."""
    flat = flat_bytes(t)
    _, per_row = rows_of(tuple(t.shape))
    row_bytes = per_row * t.element_size()
    step = grid.step * row_bytes if grid.step else chunk_bytes
    for start in range(0, t.nbytes, step):
        view = flat[start:start + step]
        yield view, (view.nbytes // row_bytes if grid.step else 0), row_bytes


def strips_for(per_row: int, row_bytes: int) -> int:
    """Equal column strips of a row: the widest split among ``STRIPS`` (8 fits TP 1, 2,
    4 and 8) whose strips stay at least ``MIN_STRIP_BYTES`` wide; else 1."""
    for k in STRIPS:
        if per_row % k == 0 and row_bytes // k >= MIN_STRIP_BYTES:
            return k
    return 1


def _tile(meta: p.ChunkMeta, view, rows: int, row_bytes: int, grid: Grid, kind: str) -> None:
    """Hash the chunk again as tiles (row blocks x column strips), when there is more
    than one: one contiguous copy per row block, then one digest per strip."""
    strips, tile_rows = grid.strips, grid.tile_rows
    strip = row_bytes // strips
    if strips == 1 and tile_rows >= rows:
        return
    grid_ = view.view(rows, strips, strip)
    tiles = []
    for r in range(0, rows, tile_rows):
        block = grid_[r:r + tile_rows].permute(1, 0, 2).contiguous()
        tiles += [digest_of(block[k].reshape(-1), kind) for k in range(strips)]
    meta.tile_rows, meta.strips, meta.tiles = min(tile_rows, rows), strips, tiles
