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
    assert {(r.source, r.partial) for r in first.reads} == {("t", False)}
    done = hub.plan(0, p.Plan(name="tp0", model="policy", version=1, want=want(), layout="X",
                              partial=[r.chunk for r in first.reads]))
    assert done.complete
    v = hub.models["policy"][1]
    assert v.replicas["tp0"].held == 0  # tiles are no whole chunk: nobody else may read them as one
    # A second reader of layout X is planned onto the first one's tiles.
    second = hub.plan(0, p.Plan(name="tp0b", model="policy", version=1, want=want(0, 1), layout="X"))
    assert {(r.source, r.partial) for r in second.reads} == {("tp0", True)}
    # A reader of another layout is not: its tiles are other tiles.
    other = hub.plan(0, p.Plan(name="y", model="policy", version=1, want=want(0, 1), layout="Y"))
    assert {(r.source, r.partial) for r in other.reads} == {("t", False)}
    # A whole-chunk reader in the same DC still gets every chunk from the trainer: the
    # tiles must not count as chunks readers there relay (the publisher would withhold them).
    fetch_all(hub, 0, "whole", "policy", 1)
    assert hub.models["policy"][1].replicas["whole"].held == 0b11
