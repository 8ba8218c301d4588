"""Box geometry (layout/boxes.py) against brute force: every element of small tensors enumerated.

Shapes have 0..4 dims of 0..5 elements, so a tensor has at most 625 elements and a
property can afford to list them all; the geometry under test never does.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub_cli.layout.boxes import (Box, contains, cover_problems, flat_runs, intersect, layout_id,
                                        range_boxes, split)

FAST = settings(max_examples=300, deadline=None)

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


def elems(box: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))))


def flat(coord, shape) -> int:
    out = 0
    for c, s in zip(coord, shape):
        out = out * s + c
    return out


@st.composite
def box_in(draw, shape):
    offsets, sizes = [], []
    for s in shape:
        o = draw(st.integers(0, s))
        offsets.append(o)
        sizes.append(draw(st.integers(0, s - o)))
    return Box(tuple(offsets), tuple(sizes))


@st.composite
def shape_and_box(draw):
    shape = draw(shapes)
    return shape, draw(box_in(shape))


@st.composite
def two_boxes(draw):
    n = draw(st.integers(0, 4))
    one = st.tuples(*[st.integers(0, 5)] * n)
    return Box(draw(one), draw(one)), Box(draw(one), draw(one))


# --- Box itself -------------------------------------------------------------------------------


def test_box_basics_and_bad_fields():
    b = Box([1, 2], [3, 0])
    assert b == Box((1, 2), (3, 0)) and hash(b) == hash(Box((1, 2), (3, 0)))
    assert b.ends == (4, 2) and b.volume == 0
    assert Box((), ()).volume == 1
    assert Box.whole((2, 3)) == Box((0, 0), (2, 3))
    assert Box((1, 2), (3, 4)).shift((2, -2)) == Box((3, 0), (3, 4))
    assert Box((3, 5), (1, 1)).local((2, 5)) == Box((1, 0), (1, 1))
    with pytest.raises(ValueError, match="Box.sizes"):
        Box((0,), (-1,))
    with pytest.raises(ValueError, match="Box.offsets"):
        Box((1.5,), (1,))
    with pytest.raises(ValueError, match="Box.sizes"):
        Box((0, 0), (1,))
    with pytest.raises(ValueError, match="by"):
        Box((1,), (1,)).shift((1, 2))
    with pytest.raises(ValueError, match="by"):
        Box((1,), (1,)).shift((-2,))
    with pytest.raises(ValueError, match="origin"):
        Box((1,), (1,)).local((2,))
    with pytest.raises(ValueError, match="shape"):
        Box.whole((2, -1))


@FAST
@given(two_boxes())
def test_intersect_is_the_set_intersection(ab):
    a, b = ab
    common = elems(a) & elems(b)
    got = intersect(a, b)
    assert (got is None) == (not common)
    if got is not None:
        assert got.volume > 0 and elems(got) == common
    assert contains(a, b) == (elems(b) <= elems(a))


def test_mismatched_dims_are_refused():
    with pytest.raises(ValueError, match="b: has 1 dims, a has 2"):
        intersect(Box((0, 0), (1, 1)), Box((0,), (1,)))
    with pytest.raises(ValueError, match="inner"):
        contains(Box((0, 0), (1, 1)), Box((0,), (1,)))
    with pytest.raises(TypeError, match="b: expected a Box"):
        intersect(Box((0,), (1,)), (0, 1))


# --- range_boxes ------------------------------------------------------------------------------


@st.composite
def shape_and_range(draw, dims=shapes):
    shape = draw(dims)
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    return shape, start, draw(st.integers(start, total))


def is_contiguous(box: Box, shape) -> bool:
    idx = sorted(flat(c, shape) for c in elems(box))
    return idx == list(range(idx[0], idx[0] + len(idx))) if idx else False


@FAST
@given(shape_and_range())
def test_range_boxes_tile_the_range_in_order(case):
    shape, start, stop = case
    boxes = range_boxes(start, stop, shape)
    covered = []
    for box in boxes:
        assert len(box.sizes) == len(shape) and all(e <= s for e, s in zip(box.ends, shape))
        assert is_contiguous(box, shape), box
        covered += sorted(flat(c, shape) for c in elems(box))
    # In order, disjoint and exact at once: concatenated in the boxes' order they are the range.
    assert covered == list(range(start, stop))
    if shape:
        assert len(boxes) <= 2 * len(shape) - 1


def fewest(start, stop, shape) -> int:
    """Brute force: the fewest contiguous pieces, each a box, that [start, stop) cuts into."""
    coords = list(itertools.product(*(range(s) for s in shape)))

    def boxlike(a, b):
        pts = coords[a:b]
        spans = [range(min(c[d] for c in pts), max(c[d] for c in pts) + 1) for d in range(len(shape))]
        return math.prod(len(r) for r in spans) == len(pts)

    best = [0] + [math.inf] * (stop - start)
    for b in range(start + 1, stop + 1):
        best[b - start] = min(best[a - start] + 1 for a in range(start, b) if boxlike(a, b))
    return best[-1]


@settings(max_examples=150, deadline=None)
@given(shape_and_range(st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)))
def test_range_boxes_are_the_fewest(case):
    shape, start, stop = case
    assert len(range_boxes(start, stop, shape)) == fewest(start, stop, shape)


def test_range_boxes_scalar_empty_and_bad_bounds():
    assert range_boxes(0, 1, ()) == [Box((), ())]
    assert range_boxes(1, 1, ()) == [] and range_boxes(0, 0, (0, 3)) == []
    assert range_boxes(0, 12, (3, 4)) == [Box((0, 0), (3, 4))]
    assert range_boxes(1, 11, (3, 4)) == [Box((0, 1), (1, 3)), Box((1, 0), (1, 4)), Box((2, 0), (1, 3))]
    with pytest.raises(ValueError, match="start"):
        range_boxes(-1, 2, (3,))
    with pytest.raises(ValueError, match="stop: 4 is past"):
        range_boxes(0, 4, (3,))
    with pytest.raises(ValueError, match="stop: 1 is before start 2"):
        range_boxes(2, 1, (3,))


# --- flat_runs --------------------------------------------------------------------------------


@FAST
@given(shape_and_box())
def test_flat_runs_are_the_box_maximal_and_ascending(case):
    shape, box = case
    runs = flat_runs(box, shape)
    expanded = [i for start, n in runs for i in range(start, start + n)]
    assert expanded == sorted(flat(c, shape) for c in elems(box))
    assert all(n > 0 for _, n in runs)
    for (s0, n0), (s1, _) in itertools.pairwise(runs):
        assert s0 + n0 < s1  # ascending and never touching: merged where they could be


def test_flat_runs_walk_rows_not_elements():
    # 10**12 elements: anything per element would never finish.
    assert flat_runs(Box((2, 0), (3, 10**6)), (10**6, 10**6)) == [(2 * 10**6, 3 * 10**6)]
    assert flat_runs(Box((0, 5), (4, 2)), (4, 10**9)) == [(k * 10**9 + 5, 2) for k in range(4)]
    assert flat_runs(Box((), ()), ()) == [(0, 1)]
    with pytest.raises(ValueError, match="box: .* outside the shape"):
        flat_runs(Box((1,), (3,)), (3,))
    with pytest.raises(ValueError, match="box: .* 1 dims"):
        flat_runs(Box((0,), (3,)), (3, 3))


# --- split ------------------------------------------------------------------------------------


def test_split_is_torch_chunk_and_dtensor_shard():
    import torch
    from torch.distributed.tensor import Shard

    for n in range(0, 41):
        t = torch.arange(n)
        for parts in range(1, 13):
            got = [split(n, parts, i) for i in range(parts)]
            assert [i for s, k in got for i in range(s, s + k)] == list(range(n))
            assert all(s == min(i * -(-n // parts), n) for i, (s, _) in enumerate(got))
            chunks = torch.chunk(t, parts)  # may return fewer than parts: the rest are empty
            assert [k for _, k in got] == [c.numel() for c in chunks] + [0] * (parts - len(chunks))
            # A private method, but it is what DTensor itself cuts a Shard(0) with.
            shards, _ = Shard(0)._split_tensor(t, parts, with_padding=False)
            assert [(int(c[0]) if c.numel() else s, c.numel()) for c, (s, _) in zip(shards, got)] == got


def test_split_bad_arguments():
    for args, field in [((5, 0, 0), "parts"), ((5, 2, 2), "i"), ((5, 2, -1), "i"), ((-1, 2, 0), "n")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            split(*args)


# --- cover_problems ---------------------------------------------------------------------------


@st.composite
def grid_cover(draw):
    """An exact cover: every dim cut at random points, one box per cell of the grid."""
    shape = draw(shapes)
    cuts = [sorted({0, s, *draw(st.lists(st.integers(0, s), max_size=2))}) for s in shape]
    spans = [list(itertools.pairwise(c)) or [(0, 0)] for c in cuts]
    boxes = [Box(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)) for cell in itertools.product(*spans)]
    return shape, draw(st.permutations(boxes))


@st.composite
def maybe_cover(draw):
    """A grid cover, often spoiled: a box dropped, duplicated, moved, resized or given a wrong ndim."""
    shape, boxes = draw(grid_cover())
    boxes = list(boxes)
    how = draw(st.sampled_from(["keep", "drop", "dup", "shift", "grow", "ndim", "extra"]))
    k = draw(st.integers(0, len(boxes) - 1)) if boxes else None
    if how == "drop" and boxes:
        boxes.pop(k)
    elif how == "dup" and boxes:
        boxes.append(boxes[k])
    elif how == "shift" and boxes and shape:
        d = draw(st.integers(0, len(shape) - 1))
        boxes[k] = boxes[k].shift(tuple(int(i == d) for i in range(len(shape))))
    elif how == "grow" and boxes and shape:
        d = draw(st.integers(0, len(shape) - 1))
        b = boxes[k]
        boxes[k] = Box(b.offsets, tuple(s + (i == d) for i, s in enumerate(b.sizes)))
    elif how == "ndim":
        boxes.append(Box((0,) * (len(shape) + 1), (1,) * (len(shape) + 1)))
    elif how == "extra":
        boxes.append(draw(box_in(shape)))
    return shape, boxes


@FAST
@given(maybe_cover())
def test_cover_problems_empty_iff_exact_cover(case):
    shape, boxes = case
    problems = cover_problems("w", shape, boxes)
    wrong_ndim = any(len(b.sizes) != len(shape) for b in boxes)
    in_bounds = all(all(e <= s for e, s in zip(b.ends, shape)) for b in boxes if len(b.sizes) == len(shape))
    count = dict.fromkeys(itertools.product(*(range(s) for s in shape)), 0)
    for b in boxes:
        if len(b.sizes) == len(shape):
            for c in elems(b):
                if c in count:
                    count[c] += 1
    exact = not wrong_ndim and in_bounds and all(v == 1 for v in count.values())
    assert (problems == []) == exact, problems
    assert all(p.startswith("w: ") for p in problems)
    missing = sum(v == 0 for v in count.values())
    gaps = [p for p in problems if "not covered" in p]
    assert gaps == ([f"w: {missing} of {len(count)} elements are not covered by any box"] if missing else [])


def test_cover_problems_messages_name_what_is_wrong():
    shape = (4, 6)
    assert cover_problems("w", shape, [Box((0, 0), (2, 6)), Box((2, 0), (2, 6))]) == []
    problems = cover_problems("layers.0.w", shape, [Box((0, 0), (3, 6)), Box((2, 0), (2, 6)), Box((0,), (4,)),
                                                    Box((3, 5), (1, 2))])
    assert problems == [
        "layers.0.w: box 2 [0:4] has 1 dims, the tensor has 2 (4, 6)",
        "layers.0.w: box 3 [3:4, 5:7] lies outside the global shape (4, 6)",
        "layers.0.w: boxes 0 [0:3, 0:6] and 1 [2:4, 0:6] overlap on [2:3, 0:6] (6 elements)",
        "layers.0.w: boxes 1 [2:4, 0:6] and 3 [3:4, 5:7] overlap on [3:4, 5:6] (1 elements)",
    ]
    assert cover_problems("b", (5,), [Box((1,), (2,))]) == ["b: 3 of 5 elements are not covered by any box"]
    assert cover_problems("s", (), [Box((), ())]) == [] and cover_problems("s", (), []) != []


# --- layout_id --------------------------------------------------------------------------------


def test_layout_id_is_order_free_and_tells_layouts_apart():
    pieces = [("a", Box((0, 0), (2, 4))), ("a", Box((2, 0), (2, 4))), ("b", Box((0,), (7,)))]
    base = layout_id(pieces)
    assert len(base) == 16 and int(base, 16) >= 0
    for perm in itertools.permutations(pieces):
        assert layout_id(iter(perm)) == base
    # A replica of a piece (every TP rank's copy of a norm) does not make another layout.
    assert layout_id(pieces + [pieces[2]]) == base
    # Pinned: ids are compared across processes and releases, so the encoding must not drift.
    assert base == layout_id([("b", Box([0], [7])), ("a", Box([2, 0], [2, 4])), ("a", Box([0, 0], [2, 4]))])
    assert base == "5075beebd1887194"
    others = [
        [pieces[0], ("a", Box((2, 0), (2, 3))), pieces[2]],
        [pieces[0], ("a", Box((1, 0), (2, 4))), pieces[2]],
        [pieces[0], ("c", Box((2, 0), (2, 4))), pieces[2]],
        pieces[:2],
    ]
    assert len({base, *map(layout_id, others)}) == 1 + len(others)
    with pytest.raises(ValueError, match=r"pieces\[0\]"):
        layout_id([(1, Box((0,), (1,)))])
    with pytest.raises(TypeError, match=r"pieces\[1\]"):
        layout_id([pieces[0], ("a", (0, 1))])


@FAST
@given(st.lists(st.tuples(st.sampled_from("abc"), shape_and_box().map(lambda sb: sb[1])), max_size=6), st.randoms())
def test_layout_id_depends_on_the_set_only(pieces, rnd):
    shuffled = list(pieces)
    rnd.shuffle(shuffled)
    assert layout_id(shuffled) == layout_id(pieces)
    if pieces:
        name, box = pieces[0]
        moved = Box(box.offsets, tuple(s + 1 for s in box.sizes)) if box.sizes else None
        if moved is not None and (name, moved) not in pieces:
            assert layout_id([(name, moved)] + pieces[1:]) != layout_id(pieces)
