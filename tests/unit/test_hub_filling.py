"""A reader's beats tell the hub how far its fetch is (``Heartbeat.filling``): operators
see it in ``held_bytes``; the hub never plans a read from it (only a report makes a
reader a holder of a chunk: contract 5, a chunk is served once verified *and reported*)."""

from __future__ import annotations

from tensorhub_cli.hub import protocol as p

from .hubkit import info, manifest, new_hub, reg

CHUNK = 1024


def setup():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("b", node="n2"), info("c", node="n3"))
    hub.publish(0, p.Publish(name="t", model="m", version=1, manifest=manifest(8, CHUNK), rank=0, world=1))
    first = hub.plan(0, p.Plan(name="a", model="m", version=1, window=2))
    return hub, [r.chunk for r in first.reads]


def held_bytes(hub, name: str) -> int:
    [v] = hub.versions(0, p.Versions(model="m")).versions
    return next(h.held_bytes for h in v.holders if h.name == name)


def beat(hub, now, name, *fills):
    return hub.heartbeat(now, p.Heartbeat(name=name, filling=list(fills)))


def test_a_beat_shows_progress_and_a_later_one_replaces_it():
    hub, _ = setup()
    assert held_bytes(hub, "a") == 0
    beat(hub, 1, "a", p.Filling(model="m", version=1, held=p.bitset(0b11)))
    assert held_bytes(hub, "a") == 2 * CHUNK
    beat(hub, 2, "a", p.Filling(model="m", version=1, held=p.bitset(0b1011)))
    assert held_bytes(hub, "a") == 3 * CHUNK
    # ids past the version's last chunk are not counted
    beat(hub, 3, "a", p.Filling(model="m", version=1, held=p.bitset(0b1 | 1 << 40)))
    assert held_bytes(hub, "a") == CHUNK


def test_told_chunks_are_never_planned_from_reported_ones_are():
    hub, reads = setup()
    told = reads[:2]
    beat(hub, 1, "a", p.Filling(model="m", version=1, held=p.bitset(p.mask_of(told))))
    got = hub.plan(1, p.Plan(name="b", model="m", version=1, window=8))
    assert got.reads and all(r.source == "t" for r in got.reads)
    # control: once reported, the same chunks are read from a (a reader before a publisher)
    hub.progress(2, p.Progress(name="a", model="m", version=1, chunks=told))
    other = hub.plan(2, p.Plan(name="c", model="m", version=1, window=8))
    assert {r.chunk for r in other.reads if r.source == "a"} == set(told)


def test_a_beat_naming_what_the_hub_does_not_know_is_still_a_beat():
    hub, _ = setup()
    seen = hub.endpoints["a"].last_seen
    out = beat(hub, 4, "a", p.Filling(model="m", version=9, held=b"\x01"),
               p.Filling(model="other", version=1, held=b"\x01"))
    assert isinstance(out, p.Ok) and hub.endpoints["a"].last_seen == 4 > seen
    # a publisher's shard is whole from the start: its beat changes nothing of it
    beat(hub, 4, "t", p.Filling(model="m", version=1, held=b"\x01"))
    assert hub.models["m"][1].replicas["t"].told == 0 and held_bytes(hub, "t") == 8 * CHUNK
