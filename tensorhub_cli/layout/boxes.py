"""Box geometry: which part of a global tensor a piece covers, in pure Python ints.

Protocol. A ``Box`` is per-dimension ``offsets`` and ``sizes`` in elements (both
non-negative, one per dimension; a 0-d box ``Box((), ())`` is the one element of a
scalar). Boxes are values: frozen, hashable, compared by content. Every function
here is pure (no torch, no numpy, no I/O) and cheap in the number of boxes and
dimensions, never in the number of elements:

- ``intersect(a, b)``: the common box, ``None`` when it is empty;
- ``contains(outer, inner)``: ``inner``'s elements all lie in ``outer`` (an empty
  ``inner`` lies in anything);
- ``range_boxes(start, stop, shape)``: the flat row-major range ``[start, stop)``
  as the fewest boxes, in flat order, each a contiguous flat range;
- ``flat_runs(box, shape)``: the contiguous flat runs ``(start, length)`` a box
  covers in a row-major tensor, ascending and maximal;
- ``split(n, parts, i)``: part ``i`` of ``n`` cut as ``torch.chunk`` / DTensor
  ``Shard`` cut it;
- ``cover_problems(name, shape, boxes)``: every reason the boxes are not an exact
  cover of the tensor (empty: they are);
- ``layout_id(pieces)``: a stable 16-hex-char id of a set of ``(name, box)``.

Bad input raises ``ValueError`` (``TypeError`` for a non-Box) naming the argument
or field at fault.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

import msgspec
import xxhash


def _ints(value, field: str) -> tuple[int, ...]:
    """A tuple of non-negative ints; floats and negatives are someone's bug, not a size."""
    try:
        out = tuple(operator.index(v) for v in value)
    except TypeError:
        raise ValueError(f"{field}: {value!r} is not a sequence of ints") from None
    if any(v < 0 for v in out):
        raise ValueError(f"{field}: {out} has a negative entry")
    return out


def _same_ndim(a: Box, b: Box, name_a: str = "a", name_b: str = "b") -> None:
    for box, name in ((a, name_a), (b, name_b)):
        if not isinstance(box, Box):
            raise TypeError(f"{name}: expected a Box, got {type(box).__name__}")
    if len(a.sizes) != len(b.sizes):
        raise ValueError(f"{name_b}: has {len(b.sizes)} dims, {name_a} has {len(a.sizes)}")


@dataclass(frozen=True, slots=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        # Normalized here so that Box([0], [2]) == Box((0,), (2,)) and hashes alike.
        object.__setattr__(self, "offsets", _ints(self.offsets, "Box.offsets"))
        object.__setattr__(self, "sizes", _ints(self.sizes, "Box.sizes"))
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"Box.sizes: {len(self.sizes)} dims but Box.offsets has {len(self.offsets)}")

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)

    @staticmethod
    def whole(shape) -> Box:
        shape = _ints(shape, "shape")
        return Box((0,) * len(shape), shape)

    def shift(self, by) -> Box:
        by = tuple(operator.index(v) for v in by)
        if len(by) != len(self.offsets):
            raise ValueError(f"by: {len(by)} entries for a box of {len(self.offsets)} dims")
        if any(o + d < 0 for o, d in zip(self.offsets, by)):
            raise ValueError(f"by: {by} moves the box {self} below 0")
        return Box(tuple(o + d for o, d in zip(self.offsets, by)), self.sizes)

    def local(self, origin) -> Box:
        origin = _ints(origin, "origin")
        if len(origin) != len(self.offsets):
            raise ValueError(f"origin: {len(origin)} entries for a box of {len(self.offsets)} dims")
        if any(o < g for o, g in zip(self.offsets, origin)):
            raise ValueError(f"origin: {origin} lies past the box's start {self.offsets}")
        return Box(tuple(o - g for o, g in zip(self.offsets, origin)), self.sizes)


def intersect(a: Box, b: Box) -> Box | None:
    _same_ndim(a, b)
    offsets = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    ends = tuple(min(x, y) for x, y in zip(a.ends, b.ends))
    if any(e <= o for o, e in zip(offsets, ends)):
        return None
    return Box(offsets, tuple(e - o for o, e in zip(offsets, ends)))


def contains(outer: Box, inner: Box) -> bool:
    _same_ndim(outer, inner, "outer", "inner")
    if inner.volume == 0:
        return True
    return all(o <= i and ie <= oe for o, i, oe, ie in zip(outer.offsets, inner.offsets, outer.ends, inner.ends))


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        out[d], acc = acc, acc * shape[d]
    return out


def range_boxes(start: int, stop: int, shape) -> list[Box]:
    shape = _ints(shape, "shape")
    total = math.prod(shape)
    start, stop = operator.index(start), operator.index(stop)
    if start < 0:
        raise ValueError(f"start: {start} is below 0")
    if stop > total:
        raise ValueError(f"stop: {stop} is past the tensor's {total} elements (shape {shape})")
    if stop < start:
        raise ValueError(f"stop: {stop} is before start {start}")
    n, strides, out = len(shape), _strides(shape), []

    def emit(prefix: tuple[int, ...], d: int, lo: int, hi: int) -> None:
        # Dims before d are pinned at prefix, dims after d full: one box.
        rest = shape[d + 1:]
        out.append(Box(prefix + (lo,) + (0,) * len(rest), (1,) * len(prefix) + (hi - lo,) + rest))

    def walk(prefix: tuple[int, ...], d: int, a: int, b: int) -> None:
        # [a, b) is local to one index of dims < d (the prefix); each level adds at most a
        # partial head row, one run of full rows and a partial tail row: 2*ndim-1 boxes at most,
        # and no two of them could be merged into one box that is still a contiguous range.
        if a == b:
            return
        if d == n:
            out.append(Box(prefix, ()))
            return
        st = strides[d]
        i, j = divmod(a, st), divmod(b, st)
        if i[0] == j[0]:
            walk(prefix + (i[0],), d + 1, i[1], j[1])
        else:
            first = i[0]
            if i[1]:
                walk(prefix + (i[0],), d + 1, i[1], st)
                first += 1
            if j[0] > first:
                emit(prefix, d, first, j[0])
            if j[1]:
                walk(prefix + (j[0],), d + 1, 0, j[1])

    walk((), 0, start, stop)
    return out


def _check_in(box: Box, shape: tuple[int, ...], field: str) -> None:
    if not isinstance(box, Box):
        raise TypeError(f"{field}: expected a Box, got {type(box).__name__}")
    if len(box.sizes) != len(shape):
        raise ValueError(f"{field}: {box} has {len(box.sizes)} dims, the shape {shape} has {len(shape)}")
    if any(e > s for e, s in zip(box.ends, shape)):
        raise ValueError(f"{field}: {box} lies outside the shape {shape}")


def flat_runs(box: Box, shape) -> list[tuple[int, int]]:
    shape = _ints(shape, "shape")
    _check_in(box, shape, "box")
    if box.volume == 0:
        return []
    # j: the first dim from which the box's elements are contiguous (every later dim full).
    j = len(shape) - 1
    while j > 0 and box.sizes[j] == shape[j]:
        j -= 1
    if j < 0:  # 0-d: the one element
        return [(0, 1)]
    strides = _strides(shape)
    length = box.sizes[j] * strides[j]
    base = sum(o * s for o, s in zip(box.offsets, strides))
    # Runs never touch: for j > 0 dim j is not full, so a gap of at least one row of dim j
    # lies between consecutive runs; ascending because product() walks in row-major order.
    outer = [range(0, sz * st, st) for sz, st in zip(box.sizes[:j], strides[:j])]
    return [(base + sum(steps), length) for steps in itertools.product(*outer)]


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    n, parts, i = operator.index(n), operator.index(parts), operator.index(i)
    if n < 0:
        raise ValueError(f"n: {n} is negative")
    if parts < 1:
        raise ValueError(f"parts: {parts} is below 1")
    if not 0 <= i < parts:
        raise ValueError(f"i: {i} is outside [0, {parts})")
    chunk = -(-n // parts)
    start = min(i * chunk, n)
    return start, min((i + 1) * chunk, n) - start


def _minus(box: Box, cut: Box) -> list[Box]:
    """``box`` without ``cut``: at most 2*ndim disjoint boxes, peeling one dim at a time."""
    common = intersect(box, cut)
    if common is None:
        return [box]
    out, offsets, sizes = [], list(box.offsets), list(box.sizes)
    for d in range(len(sizes)):
        lo, hi, end = common.offsets[d], common.ends[d], offsets[d] + sizes[d]
        if lo > offsets[d]:
            out.append(Box(offsets[:d] + [offsets[d]] + offsets[d + 1:], sizes[:d] + [lo - offsets[d]] + sizes[d + 1:]))
        if hi < end:
            out.append(Box(offsets[:d] + [hi] + offsets[d + 1:], sizes[:d] + [end - hi] + sizes[d + 1:]))
        offsets[d], sizes[d] = lo, hi - lo
    return out


def cover_problems(name: str, global_shape, boxes: list[Box]) -> list[str]:
    shape = _ints(global_shape, "global_shape")
    whole, problems, kept = Box.whole(shape), [], []
    for k, box in enumerate(boxes):
        if not isinstance(box, Box):
            raise TypeError(f"boxes[{k}]: expected a Box, got {type(box).__name__}")
        if len(box.sizes) != len(shape):
            problems.append(f"{name}: box {k} {box} has {len(box.sizes)} dims, the tensor has {len(shape)} {shape}")
            continue
        # By its ends, not contains(): an empty box placed past the tensor is still misplaced.
        if any(e > s for e, s in zip(box.ends, shape)):
            problems.append(f"{name}: box {k} {box} lies outside the global shape {shape}")
        kept.append((k, box))
    if not problems and _slabs(shape, [b for _, b in kept]):
        return []
    for (k, a), (m, b) in itertools.combinations(kept, 2):
        common = intersect(a, b)
        if common is not None:
            problems.append(f"{name}: boxes {k} {a} and {m} {b} overlap on {common} ({common.volume} elements)")
    # Union volume, exact even with overlaps: each box counts only what earlier ones left.
    # Disjoint boxes (the usual case) cost one intersect per pair.
    covered, seen = 0, []
    for _, box in kept:
        inside = intersect(box, whole)
        if inside is None:
            continue
        fresh = [inside]
        for prev in seen:
            fresh = [f for piece in fresh for f in _minus(piece, prev)]
        covered += sum(f.volume for f in fresh)
        seen.append(inside)
    if covered < whole.volume:
        problems.append(f"{name}: {whole.volume - covered} of {whole.volume} elements are not covered by any box")
    return problems


def _slabs(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    """The common exact cover, checked in O(n log n): full in every dim but one, and
    end to end along that one (what Shard(d) over any number of ranks gives). False
    says only "not this shape of cover": the general check decides."""
    if not boxes or not shape:
        return False
    split_dims = {d for b in boxes for d in range(len(shape)) if (b.offsets[d], b.sizes[d]) != (0, shape[d])}
    if len(split_dims) > 1:
        return False
    d = split_dims.pop() if split_dims else 0
    at = 0
    for b in sorted(boxes, key=lambda b: (b.offsets[d], b.sizes[d])):
        if b.offsets[d] != at:
            return False
        at += b.sizes[d]
    return at == shape[d]


def layout_id(pieces) -> str:
    """Set semantics: replicas of a piece (say, a layer norm every TP rank holds) name it once."""
    canon = set()
    for k, piece in enumerate(pieces):
        try:
            tensor, box = piece
        except (TypeError, ValueError):
            raise ValueError(f"pieces[{k}]: expected a (name, Box) pair, got {piece!r}") from None
        if not isinstance(tensor, str):
            raise ValueError(f"pieces[{k}]: name {tensor!r} is not a str")
        if not isinstance(box, Box):
            raise TypeError(f"pieces[{k}]: expected a Box, got {type(box).__name__}")
        canon.add((tensor, box.offsets, box.sizes))
    # msgpack, not joined text: a name with any character in it still encodes unambiguously.
    return f"{xxhash.xxh3_64(msgspec.msgpack.encode(sorted(canon))).intdigest():016x}"
