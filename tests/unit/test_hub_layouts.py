"""Holders per layout on the pure hub: tiles a reader of another layout holds serve
readers of that same layout only, and never hide a chunk from anyone else."""

from __future__ import annotations

from tensorhub_cli.hub import protocol as p

from .hubkit import fetch_all, info, manifest, new_hub, reg


def want(*chunks: int) -> bytes:
    mask = sum(1 << c for c in chunks)
    return mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "little")


def test_tiles_serve_their_own_layout_only_and_hide_nothing_from_whole_readers():
    hub = new_hub()
    reg(hub, 0, info("t", node="n1"), info("tp0", node="n2"), info("tp0b", node="n3"), info("whole", node="n4"),
        info("y", node="n5"))
    hub.publish(0, p.Publish(name="t", model="policy", version=1, manifest=manifest(2)))
    # A TP reader of layout X reads tiles of both chunks from the trainer and keeps them.
    first = hub.plan(0, p.Plan(name="tp0", model="policy", version=1, want=want(0, 1), layout="X"))
    assert {(r.source, r.tiled) for r in first.reads} == {("t", False)}
    done = hub.plan(0, p.Plan(name="tp0", model="policy", version=1, want=want(), layout="X",
                              tiled=[r.chunk for r in first.reads]))
    assert done.complete
    v = hub.models["policy"][1]
    assert v.replicas["tp0"].held == 0  # tiles are no whole chunk: nobody else may read them as one
    # A second reader of layout X is planned onto the first one's tiles.
    second = hub.plan(0, p.Plan(name="tp0b", model="policy", version=1, want=want(0, 1), layout="X"))
    assert {(r.source, r.tiled) for r in second.reads} == {("tp0", True)}
    # A reader of another layout is not: its tiles are other tiles.
    other = hub.plan(0, p.Plan(name="y", model="policy", version=1, want=want(0, 1), layout="Y"))
    assert {(r.source, r.tiled) for r in other.reads} == {("t", False)}
    # A whole-chunk reader in the same DC still gets every chunk from the trainer: the
    # tiles must not count as chunks readers there relay (the publisher would withhold them).
    fetch_all(hub, 0, "whole", "policy", 1)
    assert hub.models["policy"][1].replicas["whole"].held == 0b11


def test_a_group_of_shard_readers_ends_its_round_once_each_has_its_shard():
    """TP workers read only their shard (another layout): none ever holds every chunk
    whole. The round must end once each has what its boxes need, or the next update's
    `latest` would keep answering the old version until the round times out."""
    hub = new_hub()
    reg(hub, 0, info("t"), info("tp0", node="n2", group="g"), info("tp1", node="n3", group="g"))
    hub.publish(0, p.Publish(name="t", model="policy", version=1, manifest=manifest(2)))
    for name, chunk in (("tp0", 0), ("tp1", 1)):
        assert hub.resolve(0, p.Resolve(name=name, model="policy", group="g")).version == 1
        first = hub.plan(0, p.Plan(name=name, model="policy", version=1, want=want(chunk), layout="X"))
        assert [r.chunk for r in first.reads] == [chunk]
        assert hub.plan(0, p.Plan(name=name, model="policy", version=1, want=want(), layout="X",
                                  tiled=[chunk])).complete
    hub.publish(0, p.Publish(name="t", model="policy", version=2, manifest=manifest(2, salt=2)))
    assert hub.resolve(0, p.Resolve(name="tp0", model="policy", group="g")).version == 2, \
        "the round of v1 stayed open though both shard readers had loaded their shards"
    assert hub.resolve(0, p.Resolve(name="tp1", model="policy", group="g")).version == 2
    assert not hub.models["policy"][1].complete("tp0")  # (no copy for retention: it holds tiles only)


def test_a_rebuilt_hub_serves_a_readers_tiles_to_its_layout_again():
    hub = new_hub()
    reg(hub, 0, info("t", node="n1"), info("tp0", node="n2"), info("tp0b", node="n3"))
    m = manifest(2)
    hub.publish(0, p.Publish(name="t", model="policy", version=1, manifest=m))
    first = hub.plan(0, p.Plan(name="tp0", model="policy", version=1, want=want(0, 1), layout="X"))
    hub.plan(0, p.Plan(name="tp0", model="policy", version=1, want=want(), layout="X",
                       tiled=[r.chunk for r in first.reads]))
    # The hub restarts (or tp0 expired): tp0 registers again with what it holds, tiles too.
    hub = new_hub()
    reg(hub, 0, info("t", node="n1"), holdings=[p.Holding(model="policy", version=1, world=1, shards=[m], rank=0)])
    reg(hub, 0, info("tp0", node="n2"), holdings=[p.Holding(model="policy", version=1, world=1, shards=[m],
                                                          tiled=[0, 1], layout="X")])
    reg(hub, 0, info("tp0b", node="n3"))
    second = hub.plan(0, p.Plan(name="tp0b", model="policy", version=1, want=want(0, 1), layout="X"))
    assert {(r.source, r.tiled) for r in second.reads} == {("tp0", True)}, second.reads
