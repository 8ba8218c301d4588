"""Reader side of layouts: plan a fetch by box overlap (contract 9).

Protocol. ``place_boxes(shards, targets)`` maps the chunks of a version published in
one layout onto destination ``Target``s of another and returns a ``Placed`` whose
``wanted`` names the chunks the reader needs (the hub plans only those: ``Plan.want``).
Each needed chunk is read one of three ways:

- **direct**: every byte of the chunk lands in one contiguous run of a destination
  (a row block of a Shard(0) piece in a TP row slice, a whole tensor): read straight
  into it, verified whole; the reader then holds the chunk and serves it.
- **whole, staged**: the reader needs every tile of the chunk (or it has no tiles) but
  its bytes land scattered (a column piece of a whole-tensor reader): read whole into
  staging, verified whole, scattered by ``Placed.finish``; also held.
- **tiles**: the reader needs part of a chunk of whole rows: only the tiles its boxes
  touch are read (a row of strips is one descriptor per row; full-width row blocks one
  per block), each verified against the manifest's tile digest, then scattered
  (``tiles``). The chunk is not held (``Plan.tiled``): a reader never reads a whole
  chunk to cut a slice out of it.

Overlapping slots (``whole("W", a)`` beside ``tp("W", b, ...)``, or one tensor in two
targets) each get every byte of theirs: a chunk is still read once, into the first
slot that holds it in one run (or staging), and ``Placed.finish`` copies its verified
bytes into every other slot it overlaps. Refusing such destinations would cost users a
layout that is easy to want (a full copy beside a TP slice); reading a chunk twice
would cost bytes on the wire; a device copy of verified bytes costs neither.

Every accepted byte is checked against a digest from the publisher (contract 5):
the chunk's, or its tiles'. ``LayoutError`` (nothing registered, nothing written)
names each tensor at fault: a slot naming a tensor the version lacks, a global shape,
dtype or box that does not match the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engines.base import Region
from ..hub import protocol as p
from .boxes import Box, intersect, layout_id, range_boxes
from .placed import Placed
from .targets import Slot, Target
from .tensors import LayoutError, check_tensors, dtype_name, flat_bytes
from .tiles import aligned, fill_tiled, slices, slot_copies, tile_bytes, tiles_needed

@dataclass(slots=True)
class _Piece:
    meta: p.TensorMeta
    origin: tuple[int, ...]
    shape: tuple[int, ...]
    elem: int


@dataclass(slots=True)
class _Group:
    """Elements [e0, e1) of one piece, spread over staged chunks: scattered once all
    are in (``Placed.finish`` calls ``arrived`` per verified chunk)."""

    piece: _Piece
    spans: list  # (chunk, byte offset in the chunk, nbytes[, the chunk's staging view])
    e0: int
    e1: int
    slots: list[Slot]
    skip: int = 0  # bytes of a partial head element before e0
    left: set = field(default_factory=set)

    def arrived(self, chunk: int) -> None:
        self.left.discard(chunk)
        if not self.left:
            _scatter_group(self)


@dataclass(slots=True)
class _Reads:
    """How the needed chunks are read, decided chunk by chunk (``_plan_chunk``)."""

    staged: list[tuple[int, int]] = field(default_factory=list)  # (chunk, nbytes): read whole into staging
    tiled: dict[int, tuple] = field(default_factory=dict)  # chunk -> its ``tiles_needed`` plan
    groups: list[_Group] = field(default_factory=list)  # copies made once their chunks are verified


def place_boxes(shards: list[p.Manifest], targets: list[Target]) -> Placed:
    pieces, slots, device = _checked(shards, targets)
    owner = {id(s): t for t in targets for s in t.slots}
    placed = Placed(views=[], regions=[], device=device, wanted=set())
    reads = _Reads()
    first = 0
    for rank, m in enumerate(shards):
        _plan_shard(placed, reads, m, pieces[rank], slots, owner, first)
        first += len(m.chunks)
    # Readers of one layout id read the same tiles of the same chunks, staged alike: one
    # serves another its staged tiles as they lie (``Read.tiled``).
    placed.layout = layout_id([(s.name, s.box) for ss in slots.values() for s in ss]
                              + [(f"tiled:{g}", Box((), ())) for g in reads.tiled])
    _stage(placed, reads, [meta for m in shards for meta in m.chunks], device)
    _arm(placed, reads.groups)
    for t in targets:
        if t.tensor.nbytes:
            placed.regions.append(Region(t.tensor.data_ptr(), t.tensor.nbytes, device))
            placed.keep.append(t.tensor)
    return placed


# --- which chunks, read how ----------------------------------------------------------


def _plan_shard(placed: Placed, reads: _Reads, m: p.Manifest, mine: list[_Piece], slots: dict[str, list[Slot]],
                owner: dict, first: int) -> None:
    """Decide every chunk of one publisher's shard (global chunk ids from ``first``)."""
    spans = _chunk_spans(m, mine)
    open_groups: dict[int, _Group] = {}  # a piece's bytes staged so far, up to an element boundary
    start = 0  # the chunk's first byte in the shard
    for c, meta in enumerate(m.chunks):
        g = first + c
        placed.views.append(None)
        placed.digests.append(meta.digest)
        needed = [(pc, lo, hi, [s for s in slots.get(pc.meta.name, ()) if _touches(pc, lo, hi, s)])
                  for pc, lo, hi in spans[c]]
        touched = {id(pc) for pc, _, _, ss in needed if ss}
        for key in [k for k in open_groups if k not in touched]:
            reads.groups.append(open_groups.pop(key))  # its tail element touches no slot: done
        if touched:
            placed.wanted.add(g)
            _plan_chunk(placed, reads, g, meta, start, needed, slots, owner, open_groups)
        start += meta.nbytes
    reads.groups += open_groups.values()


def _plan_chunk(placed: Placed, reads: _Reads, g: int, meta: p.ChunkMeta, start: int, needed: list,
                slots: dict[str, list[Slot]], owner: dict, open_groups: dict[int, _Group]) -> None:
    """Chunk ``g`` (``needed``: per piece in it, its bytes and the slots they touch) is
    read direct, as tiles, or whole into staging, in that order of preference."""
    if len(needed) == 1:
        pc, lo, hi, ss = needed[0]
        direct = _direct(pc, lo, hi, ss, owner)
        if direct is not None:
            placed.views[g], into = direct
            others = [s for s in ss if s is not into]
            if others:  # overlapping slots: read once, copied into the others once verified
                reads.groups.append(_Group(pc, [(g, 0, hi - lo)], lo // pc.elem, hi // pc.elem, others))
            return
        if meta.tiles and (plan := tiles_needed(pc, lo, meta, ss)):
            reads.tiled[g] = plan
            return
    reads.staged.append((g, meta.nbytes))
    _group_staged(reads, g, start, needed, slots, open_groups)


def _group_staged(reads: _Reads, g: int, start: int, needed: list, slots: dict[str, list[Slot]],
                  open_groups: dict[int, _Group]) -> None:
    """Staged chunk ``g``'s share of each piece joins that piece's open group; a group
    closes at an element boundary (an element may straddle two chunks)."""
    for pc, lo, hi, ss in needed:
        if not ss:
            continue
        grp = open_groups.get(id(pc))
        if grp is None:  # a partial head element touches no slot (else the last chunk had it)
            e0 = -(-lo // pc.elem)
            grp = open_groups[id(pc)] = _Group(pc, [], e0, 0, slots[pc.meta.name], e0 * pc.elem - lo)
        grp.spans.append((g, pc.meta.offset + lo - start, hi - lo))
        grp.e1 = hi // pc.elem
        if hi % pc.elem == 0:
            reads.groups.append(open_groups.pop(id(pc)))


def _stage(placed: Placed, reads: _Reads, chunk_meta: list[p.ChunkMeta], device: int) -> None:
    """One staging buffer for the staged and tiled chunks; their views point into it."""
    import torch

    sizes = [n for _, n in reads.staged] + [sum(tile_bytes(plan)) for plan in reads.tiled.values()]
    staging = _staging(torch, sizes, device)
    if staging is None:
        return
    placed.regions.append(Region(staging.data_ptr(), staging.nbytes, device))
    placed.keep.append(staging)
    at = 0
    for g, n in reads.staged:
        placed.views[g] = staging[at:at + n]
        at = aligned(at + n)
    for g, plan in reads.tiled.items():
        at = fill_tiled(placed, g, plan, chunk_meta[g], staging, at)


def _arm(placed: Placed, groups: list[_Group]) -> None:
    """Each group waits on its chunks (``Placed.waiting``), reading their final views."""
    for grp in groups:
        if grp.e1 <= grp.e0:
            continue
        grp.left = {c for c, *_ in grp.spans}
        for chunk in grp.left:
            placed.waiting.setdefault(chunk, []).append(grp)
        grp.spans = [(c, lo, n, placed.views[c]) for c, lo, n in grp.spans]


# --- checks ---------------------------------------------------------------------------


def _checked(shards: list[p.Manifest], targets: list[Target]):
    """(pieces per shard, slots by tensor name, device), or ``LayoutError`` naming every
    problem before anything is registered."""
    pieces, problems = _pieces(shards)
    slots: dict[str, list[Slot]] = {}
    for target in targets:
        for s in target.slots:
            slots.setdefault(s.name, []).append(s)
    problems += _check_slots(pieces, slots)
    regs, device = check_tensors({f"target {i}": t.tensor for i, t in enumerate(targets)})
    problems += regs
    if problems:
        raise LayoutError("the destination does not match the version's layout; nothing was written", problems)
    return pieces, slots, device


def _pieces(shards: list[p.Manifest]) -> tuple[list[list[_Piece]], list[str]]:
    import torch

    out, problems = [], []
    for m in shards:
        mine = []
        for t in m.tensors:
            dtype = getattr(torch, t.dtype, None)
            if not isinstance(dtype, torch.dtype):
                problems.append(f"{t.name}: dtype {t.dtype!r} is not a torch dtype")
                continue
            elem = torch.empty((), dtype=dtype).element_size()
            mine.append(_Piece(t, tuple(t.box_offsets or (0,) * len(t.shape)), tuple(t.shape), elem))
        out.append(mine)
    return out, problems


def _check_slots(pieces: list[list[_Piece]], slots: dict[str, list[Slot]]) -> list[str]:
    known: dict[str, _Piece] = {}
    for mine in pieces:
        for pc in mine:
            known.setdefault(pc.meta.name, pc)
    problems = []
    for name, ss in slots.items():
        pc = known.get(name)
        if pc is None:
            problems.append(f"{name}: not a tensor of this version")
            continue
        shape = tuple(pc.meta.global_shape or pc.meta.shape)
        for s in ss:
            if s.global_shape is not None and tuple(s.global_shape) != shape:
                problems.append(f"{name}: global shape {list(s.global_shape)}, the manifest has {list(shape)}")
            if dtype_name(s.view) != pc.meta.dtype:
                problems.append(f"{name}: dtype {dtype_name(s.view)}, the manifest has {pc.meta.dtype}")
            if len(s.box.sizes) != len(shape) or any(e > n for e, n in zip(s.box.ends, shape)):
                problems.append(f"{name}: box {s.box} lies outside the global shape {list(shape)}")
            if tuple(s.view.shape) != tuple(s.box.sizes):
                problems.append(f"{name}: a view of shape {list(s.view.shape)} cannot hold box {s.box}")
    return problems


# --- which bytes of which chunk -------------------------------------------------------


def _chunk_spans(m: p.Manifest, mine: list[_Piece]) -> list[list[tuple[_Piece, int, int]]]:
    """Per chunk: (piece, lo, hi), the bytes [lo, hi) of the piece's own flat layout
    that lie in it."""
    out, start, order = [], 0, sorted((pc for pc in mine if pc.meta.nbytes), key=lambda pc: pc.meta.offset)
    i = 0
    for c in m.chunks:
        end, here = start + c.nbytes, []
        while i < len(order) and order[i].meta.offset + order[i].meta.nbytes <= start:
            i += 1
        j = i
        while j < len(order) and order[j].meta.offset < end:
            pc = order[j]
            lo, hi = max(start, pc.meta.offset), min(end, pc.meta.offset + pc.meta.nbytes)
            if lo < hi:
                here.append((pc, lo - pc.meta.offset, hi - pc.meta.offset))
            j += 1
        out.append(here)
        start = end
    return out


def _global_boxes(pc: _Piece, e0: int, e1: int) -> list[Box]:
    return [b.shift(pc.origin) for b in range_boxes(e0, e1, pc.shape)]


def _touches(pc: _Piece, lo: int, hi: int, s: Slot) -> bool:
    return any(intersect(b, s.box) for b in _global_boxes(pc, lo // pc.elem, -(-hi // pc.elem)))


def _direct(pc: _Piece, lo: int, hi: int, ss: list[Slot], owner):
    """(the chunk's one contiguous run in a destination, the slot it lies in), or None."""
    if lo % pc.elem or hi % pc.elem:
        return None
    boxes = _global_boxes(pc, lo // pc.elem, hi // pc.elem)
    for s in ss:
        if not all(intersect(b, s.box) == b for b in boxes):
            continue
        views = [s.view[slices(b, s.box.offsets)] for b in boxes]
        ptr = views[0].data_ptr()
        at = ptr
        for v in views:
            if not v.is_contiguous() or v.data_ptr() != at:
                break
            at += v.nbytes
        else:
            target = owner[id(s)].tensor
            start = ptr - target.data_ptr()
            return flat_bytes(target)[start:start + hi - lo], s
    return None


# --- staged groups --------------------------------------------------------------------


def _scatter_group(grp: _Group) -> None:
    import torch

    parts = [view[lo:lo + n] for _, lo, n, view in grp.spans]
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    pc = grp.piece
    flat = flat[grp.skip:grp.skip + (grp.e1 - grp.e0) * pc.elem]
    if flat.data_ptr() % pc.elem:
        flat = flat.clone()  # a small tensor packed at an odd offset: align before viewing its dtype
    typed = flat.view(getattr(torch, pc.meta.dtype))
    at = 0
    for b in range_boxes(grp.e0, grp.e1, pc.shape):
        data = typed[at:at + b.volume].reshape(b.sizes)
        at += b.volume
        copies: list = []
        slot_copies(copies, data, b.shift(pc.origin), grp.slots)
        for src, dst in copies:
            dst.copy_(src)


# --- staging --------------------------------------------------------------------------


def _staging(torch, sizes: list[int], device: int):
    total = sum(aligned(n) for n in sizes)
    if not total:
        return None
    return torch.empty(total, dtype=torch.uint8, device="cpu" if device < 0 else f"cuda:{device}")
