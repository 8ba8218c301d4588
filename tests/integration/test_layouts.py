"""Contract 9 end to end: a version published in one layout, fetched in another.

Real endpoints (tcp engine, one process each side is not needed for the contract: the
engine still moves bytes over sockets between endpoints), a real hub process. The
gloo/DTensor and transformers Llama cases are in ``test_layouts_dist``.
"""

from __future__ import annotations

import pytest
import torch

from tensorhub_cli.endpoint import connect
from tensorhub_cli.errors import HubError, LayoutError
from tensorhub_cli.layout.boxes import Box, split
from tensorhub_cli.layout.targets import Part, Slot, Target, fused, tp

from .test_hub_service import TOKEN, running_hub, token_file  # noqa: F401 (a fixture)

SMALL = dict(chunk_bytes=16 << 10, small_bytes=4 << 10, heartbeat_s=0.2, engine="tcp")


@pytest.fixture
def hub(token_file):
    with running_hub(token_file) as (address, _, _):
        yield address


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96, 128, generator=g), "e": torch.randn(50, 16, 8, generator=g),
            "b": torch.randn(7, generator=g), "h": torch.randn(33, 12, generator=g).half()}


def sharded(full: dict, dim: int, rank: int, world: int) -> dict:
    out = {}
    for name, t in full.items():
        d = dim if t.dim() > dim else 0
        start, size = split(t.shape[d], world, rank)
        out[name] = Part(t.narrow(d, start, size).clone(), tuple(t.shape),
                         tuple(start if i == d else 0 for i in range(t.dim())))
    return out


def publish_sharded(address: str, full: dict, world: int, dim: int = 0, version: int = 1):
    eps = []
    for r in range(world):
        ep = connect(address, TOKEN, name=f"pub{r}", **SMALL)
        ep.publish("m", version, sharded(full, dim, r, world), shard=(r, world))
        eps.append(ep)
    return eps


def targets_for(full: dict, dim: int, rank: int, world: int) -> tuple[dict, dict]:
    into, expect = {}, {}
    for name, t in full.items():
        d = dim if t.dim() > dim else 0
        start, size = split(t.shape[d], world, rank)
        dst = torch.zeros_like(t.narrow(d, start, size).contiguous())
        into[name] = tp(name, dst, tuple(t.shape), d, rank, world)
        expect[name] = (t.narrow(d, start, size), dst)
    return into, expect


@pytest.mark.parametrize("world,dim", [(2, 1), (4, 1), (2, 0)])
def test_shard0_publishers_to_another_sharding_bit_exact_reading_about_its_share(hub, world, dim):
    full = weights()
    pubs = publish_sharded(hub, full, world)
    try:
        for rank in range(2):
            with connect(hub, TOKEN, name=f"reader{rank}", **SMALL) as ep:
                into, expect = targets_for(full, dim, rank, 2)
                assert ep.fetch("m", 1, into=into, timeout=30) == 1
                for name, (want, got) in expect.items():
                    assert torch.equal(want, got), name
                share = sum(want.nbytes for want, _ in expect.values())
                # the share plus tile rounding and the small tensors' chunk, never the whole model
                total = sum(t.nbytes for t in full.values())
                assert share <= ep.last_fetch["bytes"] <= share + (16 << 10), (ep.last_fetch, share)
                assert ep.last_fetch["bytes"] < total
    finally:
        for ep in pubs:
            ep.close()


def test_a_whole_tensor_reader_of_a_sharded_version_gets_every_byte(hub):
    full = weights(1)
    pubs = publish_sharded(hub, full, 2, dim=1)
    try:
        with connect(hub, TOKEN, name="whole", **SMALL) as ep:
            into = {n: torch.zeros_like(t) for n, t in full.items()}
            ep.fetch("m", 1, into=into, timeout=30)
            for name, t in full.items():
                assert torch.equal(into[name], t), name
    finally:
        for ep in pubs:
            ep.close()


@pytest.mark.parametrize("engine", ["tcp", "nixl"])
def test_fused_qkv_and_a_column_slice_land_exactly_over_either_engine(hub, engine):
    """NIXL reads a descriptor list (one per row of strips); tcp one ReadRanges."""
    g = torch.Generator().manual_seed(3)
    full = {"q": torch.randn(64, 32, generator=g), "k": torch.randn(16, 32, generator=g),
            "v": torch.randn(16, 32, generator=g), "o": torch.randn(128, 64, generator=g)}
    pubs = publish_sharded(hub, full, 2, dim=0)
    try:
        for rank in range(2):
            with connect(hub, TOKEN, name=f"tp{rank}", **{**SMALL, "engine": engine}) as ep:
                qkv, o = torch.zeros(32 + 8 + 8, 32), torch.zeros(128, 32)
                target = fused(qkv, [("q", (64, 32)), ("k", (16, 32)), ("v", (16, 32))], 0, rank, 2)
                ep.fetch("m", 1, into={"qkv": target, "o": tp("o", o, (128, 64), 1, rank, 2)}, timeout=30)
                want = torch.cat([full["q"][32 * rank:32 * rank + 32], full["k"][8 * rank:8 * rank + 8],
                                  full["v"][8 * rank:8 * rank + 8]])
                assert torch.equal(qkv, want)
                assert torch.equal(o, full["o"][:, 32 * rank:32 * rank + 32])
                assert ep.engine.kind == engine  # NIXL loads here (UCX over shared memory and TCP)
    finally:
        for ep in pubs:
            ep.close()


@pytest.mark.parametrize("dim", [0, 1])
def test_a_whole_tensor_beside_a_slice_of_it_both_get_every_byte_read_once(hub, dim):
    """Overlapping slots (``whole`` beside ``tp`` of one tensor, in one ``into``): every
    slot is filled, none left zero while every checksum passes, and each chunk crosses
    the wire once (the overlapping slot is a copy of verified bytes)."""
    full = weights(4)
    pubs = publish_sharded(hub, full, 2, dim=0)
    try:
        with connect(hub, TOKEN, name="overlapping", **SMALL) as ep:
            w = full["w"]
            whole_w, sl = torch.zeros_like(w), torch.zeros_like(w.chunk(2, dim)[1].contiguous())
            into = {"w_all": Target(whole_w, [Slot("w", Box((0, 0), tuple(w.shape)), whole_w, tuple(w.shape))]),
                    "w_tp": tp("w", sl, tuple(w.shape), dim, 1, 2)}
            ep.fetch("m", 1, into=into, timeout=30)
            assert torch.equal(whole_w, w)
            assert torch.equal(sl, w.chunk(2, dim)[1]), "the slice beside the whole tensor stayed zero"
            assert ep.last_fetch["bytes"] == w.nbytes, ep.last_fetch  # each chunk read once
    finally:
        for ep in pubs:
            ep.close()


def test_a_tile_corrupted_at_the_publisher_is_never_accepted(hub):
    """Contract 5 under layouts: a column reader reads tiles; a flipped byte in one of
    them fails its tile digest, and with no other holder the fetch fails, not succeeds."""
    full = {"w": torch.randn(256, 64)}
    pubs = publish_sharded(hub, full, 1)
    try:
        pubs[0].replicas.get(("m", 1)).placed.keep[0].view(-1)[5] += 1.0  # after hashing: corrupt memory
        with connect(hub, TOKEN, name="col", **SMALL) as ep:
            dst = torch.zeros(256, 32)
            with pytest.raises(Exception) as err:
                ep.fetch("m", 1, into={"w": tp("w", dst, (256, 64), 1, 0, 2)}, timeout=4, read_timeout=1)
            assert "checksum" in str(err.value) or "timed out" in str(err.value) or "unavailable" in str(err.value)
    finally:
        for ep in pubs:
            ep.close()


def test_bad_destinations_name_the_tensor_and_write_nothing(hub):
    full = weights(2)
    pubs = publish_sharded(hub, full, 2)
    try:
        with connect(hub, TOKEN, name="bad", **SMALL) as ep:
            dst = torch.zeros(48, 128, dtype=torch.float64)
            with pytest.raises(LayoutError, match="w: dtype float64"):
                ep.fetch("m", 1, into={"w": tp("w", dst, (96, 128), 0, 0, 2)}, timeout=10)
            assert not dst.any()
            wrong = torch.zeros(48, 128)
            with pytest.raises(LayoutError, match=r"w: global shape \[96, 129\]"):
                ep.fetch("m", 1, into={"w": Target(wrong, [Slot("w", Box((0, 0), (48, 128)), wrong, (96, 129))])},
                         timeout=10)
            with pytest.raises(LayoutError, match="nope: not a tensor of this version"):
                ep.fetch("m", 1, into={"x": fused(torch.zeros(2, 4), [("nope", (4, 4))], 0, 0, 2)}, timeout=10)
            assert not wrong.any()
    finally:
        for ep in pubs:
            ep.close()


def test_boxes_that_overlap_or_leave_a_gap_are_refused_naming_the_tensor(hub):
    w = torch.randn(10, 4)
    with connect(hub, TOKEN, name="p0", **SMALL) as a, connect(hub, TOKEN, name="p1", **SMALL) as b:
        a.publish("m", 1, {"w": Part(w[:6].clone(), (10, 4), (0, 0))}, shard=(0, 2))
        with pytest.raises(HubError, match=r"w: .*overlap"):
            b.publish("m", 1, {"w": Part(w[5:].clone(), (10, 4), (5, 0))}, shard=(1, 2))
        with pytest.raises(HubError, match=r"w: 4 of 40 elements are not covered"):
            b.publish("m", 1, {"w": Part(w[7:].clone(), (10, 4), (7, 0))}, shard=(1, 2))
        b.publish("m", 1, {"w": Part(w[6:].clone(), (10, 4), (6, 0))}, shard=(1, 2))  # the exact cover is READY
        with connect(hub, TOKEN, name="r", **SMALL) as r:
            out = torch.zeros(10, 4)
            r.fetch("m", 1, into={"w": out}, timeout=10)
            assert torch.equal(out, w)


def test_a_second_reader_of_the_same_layout_reads_the_first_ones_tiles_not_the_publishers(hub):
    """Item 5 of contract 9's issue: holders per layout. The column slice is read as
    tiles (held in part); a second reader of the same layout gets them from the first."""
    full = {"w": torch.randn(256, 64), "o": torch.randn(128, 64)}
    pubs = publish_sharded(hub, full, 2, dim=0)
    try:
        with connect(hub, TOKEN, name="first", **SMALL) as first:
            into, expect = targets_for(full, 1, 0, 2)
            first.fetch("m", 1, into=into, timeout=30)
            assert first.last_fetch["from_publishers"] == first.last_fetch["bytes"] > 0
            with connect(hub, TOKEN, name="second", **SMALL) as second:
                into2, expect2 = targets_for(full, 1, 0, 2)
                second.fetch("m", 1, into=into2, timeout=30)
                for name, (want, got) in expect2.items():
                    assert torch.equal(want, got), name
                assert second.last_fetch["from_publishers"] == 0, second.last_fetch
                assert second.last_fetch["bytes"] == first.last_fetch["bytes"]
    finally:
        for ep in pubs:
            ep.close()


def test_a_copy_in_the_publishers_layout_holds_every_chunk_and_serves_after_they_leave(hub):
    """An agent's retention copy (``layout.allocate``: one tensor per published piece)
    copies chunks as they are; once the trainers are gone it serves readers of any layout."""
    from tensorhub_cli.layout import allocate

    full = weights(4)
    pubs = publish_sharded(hub, full, 2, dim=1)
    with connect(hub, TOKEN, name="agentlike", **SMALL) as keeper:
        keeper.fetch("m", 1, into=allocate, timeout=30)
        held = keeper.replicas.get(("m", 1))
        assert held.placed.wanted is None and len(held.held) == len(held.placed.views)
        for ep in pubs:
            ep.close()
        with connect(hub, TOKEN, name="late", **SMALL) as late:
            into, expect = targets_for(full, 0, 1, 2)
            late.fetch("m", 1, into=into, timeout=30)
            for name, (want, got) in expect.items():
                assert torch.equal(want, got), name
            assert late.last_fetch["from_publishers"] == 0


def test_fetching_again_into_the_same_targets_reuses_the_registration_and_lands_every_byte(hub):
    """The registration cache hands the second fetch the first one's staging buffer:
    every view into staging (tiles, their checks and copies, staged groups) must follow."""
    full = {"big": torch.randn(64, 256), "n1": torch.randn(64), "n2": torch.randn(64)}
    pubs = publish_sharded(hub, full, 2, dim=0)
    try:
        with connect(hub, TOKEN, name="again", **SMALL) as ep:
            into, expect = targets_for(full, 1, 0, 2)  # columns of big: tiles; n1, n2: packed chunks
            for version in (1, 2):
                if version == 2:
                    ep.unpublish("m", 1)
                    for _, got in expect.values():
                        got.zero_()
                    for ep_pub, r in zip(pubs, range(2)):
                        ep_pub.publish("m", 2, {n: Part(t.narrow(0, *split(t.shape[0], 2, r)).clone() * 2,
                                                        tuple(t.shape), (split(t.shape[0], 2, r)[0],)
                                                        + (0,) * (t.dim() - 1))
                                               for n, t in full.items()}, shard=(r, 2))
                ep.fetch("m", version, into=into, timeout=30)
                for name, (want, got) in expect.items():
                    assert torch.equal(want * version, got), (version, name)
                assert ep.last_fetch["bytes"] > 0
    finally:
        for ep in pubs:
            ep.close()


def test_verify_of_a_destination_in_another_layout_says_why_it_cannot(hub):
    from tensorhub_cli.errors import BadArgument

    full = {"w": torch.randn(64, 64)}
    pubs = publish_sharded(hub, full, 2)
    try:
        with connect(hub, TOKEN, name="v", **SMALL) as ep:
            into, _ = targets_for(full, 1, 0, 2)
            ep.fetch("m", 1, into=into, timeout=30)
            with pytest.raises(BadArgument, match="another layout"):
                ep.verify("m", 1, {"w": torch.zeros(64, 64)})
    finally:
        for ep in pubs:
            ep.close()
