"""The simulator's deltas: a crossing read of v+1 by a holder of v moves ratio x the
chunk's bytes and pays the rebuild, reads inside a DC stay full, off changes nothing."""

import math

import pytest

from tensorhub_cli.sim import scenario as sc
from tensorhub_cli.sim import workloads as W
from tensorhub_cli.sim.params import SimParams
from tensorhub_cli.sim.world import World

CHUNK = 8 << 20
CHUNKS = 3


def params(deltas: dict | None = None, protocol: str = "window", **cluster) -> SimParams:
    return SimParams.model_validate({
        "cluster": {"gpus": 4, "gpus_per_node": 1, "nodes_per_rack": 1, "wan_gbps": 10.0, **cluster},
        "model": {"params": CHUNK * CHUNKS, "dtype_bytes": 1, "chunk_mib": CHUNK / 2**20},
        "hub": {"charge_cpu": False}, "fetch": {"protocol": protocol, "start_jitter_s": 0.0},
        "deltas": {"enabled": True, **(deltas or {})}})


def two_versions(p: SimParams, dcs: list[int], reader_gpu: int, *, reader_holds_v1: bool = True):
    """A trainer on GPU 0 publishes v1 and v2; the reader fetches v1 (when told), then v2.
    → (world, the v2 fetch, the remote and in-DC wire bytes of the v2 round)."""
    world = World(p, dcs, exact=True)
    trainer = world.endpoint("trainer-0", 0, "trainer")
    reader = world.endpoint("rollout-0", reader_gpu, "rollout")
    sc.register(world, [trainer, reader])
    shards = sc.manifests(p.model.nbytes, 1, p.model.chunk_bytes)
    sc.publish(world, [trainer], W.MODEL, 1, shards)
    if reader_holds_v1:
        sc.fetch(world, [(reader, 0, world.loop.now)], W.MODEL, 1)
    before = dict(world.wire_bytes)
    sent = world.delta_chunks
    sc.publish(world, [trainer], W.MODEL, 2, shards)
    f = sc.fetch(world, [(reader, 0, world.loop.now)], W.MODEL, 2)["rollout-0"]
    world.close()
    moved = {lv: world.wire_bytes[lv] - before[lv] for lv in before}
    return world, f, moved, world.delta_chunks - sent


@pytest.mark.parametrize("protocol", ["window", "schedule"])
def test_a_crossing_read_of_v2_by_a_holder_of_v1_moves_ratio_x_bytes(protocol):
    p = params({"ratio": 0.05}, protocol)
    world, f, moved, deltas = two_versions(p, [2, 2], reader_gpu=2)
    assert deltas == CHUNKS
    assert moved["remote"] == CHUNKS * math.ceil(0.05 * CHUNK)
    assert moved["remote"] == pytest.approx(world.net.bytes_done - (CHUNKS * CHUNK), rel=1e-9)  # v1 went in full
    assert f.bytes == CHUNKS * CHUNK  # what counts is the rebuilt chunk
    # the hub planned (and counts) full chunks: it is not told of deltas
    assert world.hub.counters["bytes_planned.level.remote"] == 2 * CHUNKS * CHUNK


@pytest.mark.parametrize("protocol", ["window", "schedule"])
def test_the_rebuild_is_paid_before_the_chunk_counts(protocol):
    slow, fast = 1.0, 1e6
    t = {}
    for rate in (slow, fast):
        _, f, _, _ = two_versions(params({"rebuild_gbps": rate, "ratio": 0.05}, protocol), [1, 1], reader_gpu=1)
        t[rate] = f.seconds
    # three chunks on two verifiers: the reader waits for two rebuilds one after the other
    per_chunk = CHUNK * 8 / 1e9
    assert t[slow] - t[fast] == pytest.approx(2 * (per_chunk / slow - per_chunk / fast), rel=0.02)


def test_without_v1_the_reader_gets_full_chunks():
    _, _, moved, deltas = two_versions(params(), [2, 2], reader_gpu=2, reader_holds_v1=False)
    assert deltas == 0 and moved["remote"] == CHUNKS * CHUNK


@pytest.mark.parametrize("level, gpus_per_node, nodes_per_rack, reader_gpu", [
    ("dc", 1, 1, 3), ("rack", 1, 4, 1), ("node", 2, 2, 1)])
def test_inside_a_dc_reads_move_full_chunks(level, gpus_per_node, nodes_per_rack, reader_gpu):
    p = params(gpus_per_node=gpus_per_node, nodes_per_rack=nodes_per_rack)  # levels: the default, remote only
    _, _, moved, deltas = two_versions(p, [4], reader_gpu=reader_gpu)
    assert deltas == 0 and moved[level] == CHUNKS * CHUNK


def test_a_level_named_in_the_setting_gets_deltas_inside_the_dc():
    p = params({"levels": ["dc", "remote"], "ratio": 0.1})
    _, _, moved, deltas = two_versions(p, [4], reader_gpu=3)
    assert deltas == CHUNKS and moved["dc"] == CHUNKS * math.ceil(0.1 * CHUNK)


def _figures(out: dict) -> dict:
    return {k: v for k, v in out.items() if not k.startswith("hub_cpu")}  # (CPU time is this machine's)


SMALL = {"cluster": {"gpus": 48, "gpus_per_node": 4, "nodes_per_rack": 2, "wan_gbps": 100},
         "roles": {"trainer_fraction": 0.25, "rollout_tp": 4}, "model": {"params": 4.0e8, "chunk_mib": 32},
         "hub": {"charge_cpu": False}}


@pytest.mark.parametrize("planner", ["ros", "star"])
def test_deltas_leave_the_one_version_cross_dc_as_it_was(planner):
    """One version has nothing to be a delta against: on or off, every figure is the same
    (and with them off the code path is the one before deltas; the report compares the
    two trees' figures)."""
    off = SimParams.model_validate(SMALL)
    on = SimParams.model_validate({**SMALL, "deltas": {"enabled": True, "levels": ["node", "rack", "dc", "remote"]}})
    t, r = W.split(off, 48)
    a, b = W.cross_dc(off, planner, t, r), W.cross_dc(on, planner, t, r)
    assert _figures(a) == _figures(b)
    assert a["wan_bytes"] == a["bytes_by_level"]["remote"]


def test_two_versions_with_deltas_off_move_what_the_hub_planned():
    p = SimParams.model_validate(SMALL)
    t, r = W.split(p, 48)
    out = W.cross_dc_versions(p, "ros", t, r)
    assert out["delta_chunks"] == 0 and out["deltas"] is False
    assert out["wan_bytes"] == out["bytes_by_level"]["remote"] == p.model.nbytes  # one copy crosses, in full
    on = W.cross_dc_versions(SimParams.model_validate({**SMALL, "deltas": {"enabled": True}}), "ros", t, r)
    assert on["bytes_by_level"]["remote"] == p.model.nbytes  # the hub still plans one full copy ...
    assert on["wan_bytes"] == pytest.approx(p.deltas.ratio * p.model.nbytes, rel=1e-3)  # ... the wire carries less
