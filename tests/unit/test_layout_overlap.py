"""Contract 9 without sockets: random publisher and reader layouts, bytes moved by hand.

A version is laid out by ``lay_out`` in one random layout (pieces along one dim, any
number of ranks, uneven), ``place_boxes`` plans a reader of another random layout,
and the "engine" here copies exactly the bytes the plan asks for (each pair from the
publisher's chunk memory). Every wanted chunk must verify, the reader's tensors must
equal the global slices bit for bit, and the bytes read must stay within the share
plus tile rounding: never the whole model for a slice.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorhub_cli.layout.boxes import Box, split
from tensorhub_cli.layout.chunking import lay_out
from tensorhub_cli.layout.overlap import place_boxes
from tensorhub_cli.layout.targets import Part, Slot, Target, fused, tp
from tensorhub_cli.errors import LayoutError

CHUNK, SMALL, TILE = 4096, 1024, 512


def pieces(t: torch.Tensor, dim: int, rank: int, world: int):
    start, size = split(t.shape[dim], world, rank)
    return t.narrow(dim, start, size), tuple(start if i == dim else 0 for i in range(t.dim()))


def publish(full: dict, dim: int, world: int):
    shards, placeds = [], []
    for r in range(world):
        sd = {}
        for name, t in full.items():
            local, at = pieces(t, min(dim, t.dim() - 1), r, world)
            if local.numel():
                sd[name] = Part(local.contiguous(), tuple(t.shape), at)
        m, placed = lay_out(sd, CHUNK, SMALL, tile_bytes=TILE)
        shards.append(m)
        placeds.append(placed)
    return shards, placeds


def move(shards, placeds, placed) -> int:
    """What the fetch loop does, minus the network: read, verify, finish."""
    sources = [v for pl in placeds for v in pl.views]
    metas = [c for m in shards for c in m.chunks]
    moved = 0
    for g in sorted(placed.wanted):
        tiled = placed.parts.get(g)
        if tiled is None:
            placed.views[g].copy_(sources[g])
        else:
            for at, view in tiled.pairs:
                view.copy_(sources[g][at:at + view.nbytes])
        assert placed.check(g, metas[g]), f"chunk {g} failed its check"
        moved += placed.read_bytes(g)
        placed.finish(g)
    return moved


def model(seed: int, rows: int, cols: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, cols, generator=g), "e": torch.randn(5, rows, 6, generator=g),
            "b": torch.randn(cols, generator=g), "h": torch.randn(3, 7, generator=g).half()}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 99), rows=st.integers(1, 80), cols=st.sampled_from([8, 16, 24, 64, 96]),
       pub_dim=st.integers(0, 2), pub_world=st.integers(1, 4), read_dim=st.integers(0, 2),
       read_world=st.integers(1, 4), rank=st.integers(0, 3))
def test_any_reader_layout_of_any_publisher_layout_is_bit_exact_and_reads_about_its_share(
        seed, rows, cols, pub_dim, pub_world, read_dim, read_world, rank):
    rank %= read_world
    full = model(seed, rows, cols)
    shards, placeds = publish(full, pub_dim, pub_world)
    targets, expect = [], {}
    for name, t in full.items():
        d = min(read_dim, t.dim() - 1)
        want, at = pieces(t, d, rank, read_world)
        dst = torch.zeros_like(want.contiguous())
        targets.append(Target(dst, [Slot(name, Box(at, tuple(dst.shape)), dst, tuple(t.shape))]))
        expect[name] = (want, dst)
    placed = place_boxes(shards, targets)
    moved = move(shards, placeds, placed)
    for name, (want, got) in expect.items():
        assert torch.equal(want, got), name
    share = sum(w.nbytes for w, _ in expect.values())
    total = sum(t.nbytes for t in full.values())
    small = sum(t.nbytes for t in full.values() if t.nbytes < SMALL) * pub_world
    # rounding: a tile row block (TILE) at each edge of each piece overlap, plus the small tensors' chunks
    assert moved <= share + small + 2 * TILE * 4 * pub_world * len(full), (moved, share, total)


def test_a_column_slice_reads_tiles_not_whole_chunks():
    full = {"w": torch.randn(256, 64)}  # 64 KiB: 16 chunks of 4 KiB, 8 strips of 32 B... 4 strips of 64 B
    shards, placeds = publish(full, 0, 1)
    dst = torch.zeros(256, 16)
    placed = place_boxes(shards, [tp("w", dst, (256, 64), 1, 0, 4)])
    assert placed.parts and set(placed.parts) == placed.wanted  # every chunk read in part
    moved = move(shards, placeds, placed)
    assert torch.equal(dst, full["w"][:, :16])
    assert moved == dst.nbytes  # exactly the column strip: 4 strips per row, one read


def test_a_corrupt_tile_fails_its_check():
    full = {"w": torch.randn(256, 64)}
    shards, placeds = publish(full, 0, 1)
    dst = torch.zeros(256, 32)
    placed = place_boxes(shards, [tp("w", dst, (256, 64), 1, 1, 2)])
    g = min(placed.parts)
    placeds[0].views[g][-1] ^= 0xFF  # the last byte of the chunk: in the second half of the last row
    at, view = placed.parts[g].pairs[-1]
    view.copy_(placeds[0].views[g][at:at + view.nbytes])
    for at, view in placed.parts[g].pairs[:-1]:
        view.copy_(placeds[0].views[g][at:at + view.nbytes])
    assert not placed.check(g, shards[0].chunks[g])


def test_fused_and_whole_targets_and_bad_ones():
    g = torch.Generator().manual_seed(1)
    full = {"q": torch.randn(64, 32, generator=g), "k": torch.randn(16, 32, generator=g)}
    shards, placeds = publish(full, 0, 2)
    qk = torch.zeros(32 + 8, 32)
    placed = place_boxes(shards, [fused(qk, [("q", (64, 32)), ("k", (16, 32))], 0, 1, 2)])
    move(shards, placeds, placed)
    assert torch.equal(qk, torch.cat([full["q"][32:], full["k"][8:]]))
    with pytest.raises(LayoutError) as err:
        place_boxes(shards, [tp("q", torch.zeros(32, 32, dtype=torch.float64), (64, 32), 0, 0, 2),
                             fused(torch.zeros(4, 32), [("x", (8, 32))], 0, 0, 2)])
    assert any(p.startswith("q: dtype float64") for p in err.value.problems)
    assert any(p.startswith("x: not a tensor of this version") for p in err.value.problems)


@pytest.mark.parametrize("order", ["whole first", "slice first"])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_chunk_inside_several_slots_fills_every_one_of_them(order, dim):
    """``whole("w", a)`` beside ``tp("w", b, ...)``: each chunk is read once, into the
    first slot that holds it in one run, and copied into every other slot it overlaps
    once verified; no slot is left zero while every check passes."""
    g = torch.Generator().manual_seed(2)
    full = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(40, generator=g),
            "c": torch.randn(24, generator=g)}  # b, c: small, packed in one staged chunk
    shards, placeds = publish(full, 0, 2)
    a, b2, c, c2 = (torch.zeros(256, 64), torch.zeros(40), torch.zeros(24), torch.zeros(24))
    tgt = [Target(a, [Slot("w", Box((0, 0), (256, 64)), a, (256, 64))]),
           tp("w", sl := torch.zeros(128 if dim == 0 else 256, 64 if dim == 0 else 32), (256, 64), dim, 1, 2),
           Target(b2, [Slot("b", Box((0,), (40,)), b2, (40,))]),
           Target(c, [Slot("c", Box((0,), (24,)), c, (24,))]), Target(c2, [Slot("c", Box((0,), (24,)), c2, (24,))])]
    if order == "slice first":
        tgt.reverse()
    placed = place_boxes(shards, tgt)
    moved = move(shards, placeds, placed)
    assert torch.equal(a, full["w"]) and torch.equal(b2, full["b"])
    assert torch.equal(c, full["c"]) and torch.equal(c2, full["c"])
    assert torch.equal(sl, full["w"].chunk(2, dim)[1]), "the second slot of w stayed (partly) zero"
    # read once: the whole model, not the model plus the slice
    assert moved <= sum(m.nbytes for sh in shards for m in sh.chunks)


def test_finish_says_when_a_verified_chunk_was_copied_on():
    """Callers make their stream wait only when ``finish`` queued copies: a chunk read
    straight into its one slot queues none; one with an overlapping slot does."""
    full = {"w": torch.randn(256, 64)}
    shards, placeds = publish(full, 0, 1)
    for extra, want in (([], False), ([tp("w", torch.zeros(128, 64), (256, 64), 0, 0, 2)], True)):
        a = torch.zeros(256, 64)
        placed = place_boxes(shards, [Target(a, [Slot("w", Box((0, 0), (256, 64)), a, (256, 64))])] + extra)
        g = min(placed.wanted)
        placed.views[g].copy_(placeds[0].views[g])
        assert placed.finish(g) is want
