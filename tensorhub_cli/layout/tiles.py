"""Reading part of a chunk: its tiles, and where read bytes land in slots.

Protocol. A chunk of whole rows is hashed as tiles (``chunking``: row blocks of
``tile_rows`` rows by ``strips`` equal column strips, each with its digest in
``ChunkMeta.tiles``). For a reader that needs part of such a chunk:

- ``tiles_needed(pc, lo, meta, slots)``: per row block, the strips any slot touches,
  or None when every tile is (then the chunk is read whole);
- ``tile_bytes(plan)``: the staging each row block of the plan takes;
- ``fill_tiled(placed, g, plan, meta, staging, at)``: lays the needed tiles out in
  ``staging`` from byte ``at`` and records, in a ``Tiled``, what to read (``pairs``:
  a row of strips is one descriptor per row, full-width row blocks one per block),
  what to check (each tile against its digest) and what to copy once verified (into
  every slot the tile overlaps); returns where the next staging piece starts.

``slot_copies`` and ``slices`` are the box-to-view geometry every path of ``overlap``
shares: which part of read data lands in which part of which slot. ``pc`` is an
``overlap`` piece (``meta``, ``origin``, ``shape``, ``elem``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hub import protocol as p
from .boxes import Box, intersect, range_boxes
from .chunking import rows_of
from .placed import Placed
from .targets import Slot

ALIGN = 64  # staging pieces start here, so any dtype can view them


@dataclass(slots=True)
class Tiled:
    """A chunk read in part: ``pairs`` (offset in the holder's chunk, local flat view),
    ``checks`` (bytes, the tile digest they must have), ``copies`` (source, destination)
    once verified, and the bytes read."""

    pairs: list[tuple[int, object]] = field(default_factory=list)
    checks: list[tuple[object, int]] = field(default_factory=list)
    copies: list[tuple[object, object]] = field(default_factory=list)
    nbytes: int = 0


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slices(box: Box, origin) -> tuple[slice, ...]:
    return tuple(slice(o - z, o - z + n) for o, z, n in zip(box.offsets, origin, box.sizes))


def row_boxes(pc, r0: int, r1: int, c0: int, c1: int) -> list[tuple[int, Box]]:
    """Rows [r0, r1) x columns [c0, c1) of a piece as local boxes, each with its first row."""
    if len(pc.shape) == 1:
        return [(r0, Box((r0,), (r1 - r0,)))]
    out, at = [], r0
    for b in range_boxes(r0, r1, pc.shape[:-1]):
        out.append((at, Box(b.offsets + (c0,), b.sizes + (c1 - c0,))))
        at += b.volume
    return out


def tiles_needed(pc, lo: int, meta: p.ChunkMeta, ss: list[Slot]):
    """Per row block with any tile needed: (first row, rows, first strip, last strip).
    None when every tile is needed (the chunk is read whole)."""
    _, per_row = rows_of(pc.shape)
    row_bytes = per_row * pc.elem
    r0, rows = lo // row_bytes, meta.nbytes // row_bytes
    width = per_row // meta.strips
    plan, every = [], True
    for b0 in range(r0, r0 + rows, meta.tile_rows):
        b1 = min(b0 + meta.tile_rows, r0 + rows)
        need = [k for k in range(meta.strips)
                if any(intersect(box.shift(pc.origin), s.box)
                       for _, box in row_boxes(pc, b0, b1, k * width, (k + 1) * width) for s in ss)]
        every &= len(need) == meta.strips
        if need:
            plan.append((b0, b1, need[0], need[-1]))
    return None if every else (pc, r0, row_bytes, width, ss, plan)


def tile_bytes(plan) -> list[int]:
    pc, _, row_bytes, width, _, blocks = plan
    strip = width * pc.elem
    return [aligned((b1 - b0) * (k1 - k0 + 1) * strip) for b0, b1, k0, k1 in blocks]


def fill_tiled(placed: Placed, g: int, plan, meta: p.ChunkMeta, staging, at: int) -> int:
    pc, r0, row_bytes, width, ss, blocks = plan
    import torch

    strip = width * pc.elem
    dtype = getattr(torch, pc.meta.dtype)
    tiled = Tiled()
    first = at
    for b0, b1, k0, k1 in blocks:
        rows, cols = b1 - b0, (k1 - k0 + 1) * strip
        buf = staging[at:at + rows * cols]
        grid = buf.view(rows, cols)
        if k0 == 0 and k1 == meta.strips - 1:  # whole rows: one descriptor for the block
            tiled.pairs.append(((b0 - r0) * row_bytes, buf))
        else:
            tiled.pairs += [((r - r0) * row_bytes + k0 * strip, grid[r - b0]) for r in range(b0, b1)]
        block = (b0 - r0) // meta.tile_rows
        for k in range(k0, k1 + 1):
            tiled.checks.append((grid[:, (k - k0) * strip:(k - k0 + 1) * strip], meta.tiles[block * meta.strips + k]))
        typed = buf.view(dtype).view(rows, cols // pc.elem)
        for first_row, box in row_boxes(pc, b0, b1, k0 * width, (k1 + 1) * width):
            n = box.volume // box.sizes[-1] if len(pc.shape) > 1 else box.volume
            data = typed[first_row - b0:first_row - b0 + n].reshape(box.sizes)
            slot_copies(tiled.copies, data, box.shift(pc.origin), ss)
        tiled.nbytes += rows * cols
        at = aligned(at + rows * cols)
    placed.views[g] = staging[first:at]
    placed.parts[g] = tiled
    return at


def slot_copies(out: list, data, box: Box, ss: list[Slot]) -> None:
    """(source, destination) views for every slot ``box``'s data overlaps."""
    for s in ss:
        common = intersect(box, s.box)
        if common is not None:
            out.append((data[slices(common, box.offsets)], s.view[slices(common, s.box.offsets)]))
