"""Contracts 1–8 on the pure hub, one scenario each (the stateful test fuzzes them)."""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.retention import Policy
from tensorhub_cli.hub.machine import HubFault

from .hubkit import EXPIRY, acks, fetch_all, info, manifest, new_hub, reg, sends


def publish(hub, now, name, version, m, rank=0, world=1, model="policy"):
    hub.publish(now, p.Publish(name=name, model=model, version=version, manifest=m, rank=rank, world=world))


def state(hub, version, model="policy"):
    return hub.models[model][version].state


def test_sharded_version_is_staging_until_every_shard_is_held():
    hub = new_hub()
    reg(hub, 0, info("t0"), info("t1", node="n2"), info("r", node="n3"))
    publish(hub, 0, "t0", 1, manifest(3), rank=0, world=2)
    assert state(hub, 1) == "STAGING"
    with pytest.raises(HubFault, match="no READY version"):
        hub.resolve(0, p.Resolve(name="r", model="policy"))
    publish(hub, 0, "t1", 1, manifest(2, salt=1), rank=1, world=2)
    assert state(hub, 1) == "READY"
    got = hub.resolve(0, p.Resolve(name="r", model="policy"))
    assert got.version == 1 and got.world == 2 and len(got.shards[1].chunks) == 2
    assert hub.models["policy"][1].replicas["t1"].held == 0b11000


def test_conflicting_manifest_is_rejected_and_changes_nothing():
    hub = new_hub()
    reg(hub, 0, info("t0"), info("t1"))
    publish(hub, 0, "t0", 1, manifest(3))
    before = hub.versions(0, p.Versions()).versions
    with pytest.raises(HubFault) as exc:
        publish(hub, 0, "t1", 1, manifest(4))
    assert exc.value.code == "conflict" and "different manifest" in exc.value.message
    with pytest.raises(HubFault, match="world"):
        publish(hub, 0, "t1", 1, manifest(3), rank=0, world=2)
    assert hub.versions(0, p.Versions()).versions == before
    assert "t1" not in hub.models["policy"][1].replicas


def test_group_round_pins_one_version_even_when_a_newer_turns_ready():
    hub = new_hub()
    reg(hub, 0, info("t"), info("a", node="n2", group="g"), info("b", node="n3", group="g"))
    publish(hub, 0, "t", 1, manifest(2))
    assert hub.resolve(0, p.Resolve(name="a", model="policy", group="g")).version == 1
    publish(hub, 0, "t", 2, manifest(2, salt=2))
    assert hub.resolve(0, p.Resolve(name="b", model="policy", group="g")).version == 1  # same round
    assert hub.resolve(0, p.Resolve(name="b", model="policy")).version == 2  # no group: latest
    fetch_all(hub, 0, "a", "policy", 1)
    fetch_all(hub, 0, "b", "policy", 1)
    nxt = hub.resolve(0, p.Resolve(name="a", model="policy", group="g"))
    assert (nxt.version, nxt.round) == (2, 2)


def test_a_round_on_a_version_every_member_holds_still_gives_it_to_each_member():
    """Members holding ``latest`` already: a's update is a no-op on v1, v2 turns READY,
    then b asks. The round is not over for b (it has not taken v1 in it yet), so b
    gets v1 too; a's next update opens the round of v2."""
    hub = new_hub()
    reg(hub, 0, info("t"), info("a", node="n2", group="g"), info("b", node="n3", group="g"))
    publish(hub, 0, "t", 1, manifest(2))
    for name in ("a", "b"):
        assert hub.resolve(0, p.Resolve(name=name, model="policy", group="g")).version == 1
        fetch_all(hub, 0, name, "policy", 1)
    assert hub.resolve(0, p.Resolve(name="a", model="policy", group="g")).version == 1
    publish(hub, 0, "t", 2, manifest(2, salt=2))
    assert hub.resolve(0, p.Resolve(name="b", model="policy", group="g")).version == 1, \
        "a member's no-op update ended the round: the group split across versions"
    assert hub.resolve(0, p.Resolve(name="a", model="policy", group="g")).version == 2


def test_group_round_ends_when_a_member_expires_or_times_out():
    hub = new_hub()
    reg(hub, 0, info("t"), info("a", group="g"), info("b", group="g"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.resolve(0, p.Resolve(name="a", model="policy", group="g"))
    hub.resolve(0, p.Resolve(name="b", model="policy", group="g"))
    publish(hub, 0, "t", 2, manifest(2, salt=2))
    hub.heartbeat(4, p.Heartbeat(name="t"))
    hub.heartbeat(4, p.Heartbeat(name="a"))
    hub.expire(6)  # b expired
    assert hub.resolve(6, p.Resolve(name="a", model="policy", group="g")).version == 2
    publish(hub, 6, "t", 3, manifest(2, salt=3))
    hub.heartbeat(6 + hub.config.round_timeout_s, p.Heartbeat(name="a"))
    hub.heartbeat(6 + hub.config.round_timeout_s, p.Heartbeat(name="t"))
    assert hub.resolve(6 + hub.config.round_timeout_s, p.Resolve(name="a", model="policy", group="g")).version == 3


def test_plan_prefers_node_then_rack_then_dc_then_remote_then_load():
    hub = new_hub()
    reg(hub, 0, info("t", node="x", rack="rx", dc="dc2"), info("reader", node="n1", rack="r1"),
        info("same-node", node="n1", rack="r1"), info("same-rack", node="n2", rack="r1"),
        info("same-dc", node="n3", rack="r2"))
    publish(hub, 0, "t", 1, manifest(8))
    m = manifest(8)
    for name in ("same-node", "same-rack", "same-dc"):
        hub.plan(0, p.Plan(name=name, model="policy", version=1, window=8))
        hub.progress(0, p.Progress(name=name, model="policy", version=1, chunks=list(range(8))))

    def sources(window):
        plan = hub.plan(0, p.Plan(name="reader", model="policy", version=1, window=window))
        out = {r.source for r in plan.reads}
        hub.cancel(0, p.Cancel(name="reader", model="policy", version=1))
        return out

    assert sources(2) == {"same-node"}
    hub.deregister(0, p.Deregister(name="same-node"))
    assert sources(2) == {"same-rack"}
    hub.deregister(0, p.Deregister(name="same-rack"))
    assert sources(2) == {"same-dc"}
    hub.deregister(0, p.Deregister(name="same-dc"))
    assert sources(2) == {"t"}
    del m


def _per_source(plan) -> dict[str, int]:
    per: dict[str, int] = {}
    for r in plan.reads:
        per[r.source] = per.get(r.source, 0) + 1
    return per


def test_plan_spreads_equal_cost_reads_over_relays_and_spares_the_publisher():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), *[info(f"h{i}", node=f"n{i + 1}") for i in range(4)], info("r", node="n9"))
    publish(hub, 0, "t", 1, manifest(16))
    for i in range(4):
        fetch_all(hub, 0, f"h{i}", "policy", 1)
    per = _per_source(hub.plan(0, p.Plan(name="r", model="policy", version=1, window=10)))
    assert sum(per.values()) == 10 and "t" not in per and len(per) == 4
    assert max(per.values()) - min(per.values()) <= 1


def test_a_shared_source_serves_at_most_its_cap_and_each_chunk_to_one_reader_at_a_time():
    hub = new_hub()  # max_reads_per_source = 4
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("b", node="n2"))
    publish(hub, 0, "t", 1, manifest(16))
    first = hub.plan(0, p.Plan(name="a", model="policy", version=1, window=8))
    assert _per_source(first) == {"t": 8}  # alone on t: the window decides, not the cap
    # t is past its cap for anyone else: b gets nothing and waits, rather than read twice from t
    assert hub.plan(0, p.Plan(name="b", model="policy", version=1, window=8)).reads == []
    done = [r.chunk for r in first.reads[:6]]
    hub.progress(0, p.Progress(name="a", model="policy", version=1, chunks=done))
    second = hub.plan(0, p.Plan(name="b", model="policy", version=1, window=8))
    from_t = {r.chunk for r in second.reads if r.source == "t"}
    assert {r.chunk for r in second.reads if r.source == "a"} == set(done)  # relayed, not re-sent by t
    assert len(from_t) == 2  # t serves 2 for a still: 2 more fill its cap of 4
    assert not from_t & {r.chunk for r in first.reads[6:]} and not from_t & set(done)


def test_never_plans_self_draining_or_expired():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("r", node="n2"))
    publish(hub, 0, "t", 1, manifest(4))
    fetch_all(hub, 0, "a", "policy", 1)
    hub.unpublish(0, p.Unpublish(name="a", model="policy", version=1))
    assert acks(hub.take_outbound())  # nothing pinned it
    plan = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4))
    assert {r.source for r in plan.reads} == {"t"}
    hub.cancel(0, p.Cancel(name="r", model="policy", version=1))
    # t silent past expiry but not yet swept: still counted a holder, never planned
    hub.heartbeat(EXPIRY + 1, p.Heartbeat(name="r"))
    late = hub.plan(EXPIRY + 1, p.Plan(name="r", model="policy", version=1))
    assert late.reads == [] and late.waiting == 4


def test_one_copy_crosses_the_dc_link_then_fans_out_from_the_seed():
    hub = new_hub()
    reg(hub, 0, info("t", node="a1", dc="east"), *[info(f"w{i}", node=f"b{i}", dc="west") for i in range(3)])
    publish(hub, 0, "t", 1, manifest(6))
    first = hub.plan(0, p.Plan(name="w0", model="policy", version=1, window=2))
    assert {r.source for r in first.reads} == {"t"}
    second = hub.plan(0, p.Plan(name="w1", model="policy", version=1, window=6))
    assert second.reads == [] and second.waiting == 6  # waits for the seed, no second crossing
    hub.progress(0, p.Progress(name="w0", model="policy", version=1, chunks=[r.chunk for r in first.reads]))
    hub.plan(0, p.Plan(name="w0", model="policy", version=1, window=2))  # the seed keeps fetching
    second = hub.plan(0, p.Plan(name="w1", model="policy", version=1, window=6))
    assert {r.source for r in second.reads} == {"w0"} and len(second.reads) == 2
    # Fetch everything, polling round-robin: each chunk crosses the link exactly once.
    done = set()
    for _ in range(50):
        for name in ("w0", "w1", "w2"):
            plan = hub.plan(0, p.Plan(name=name, model="policy", version=1, window=2))
            if plan.complete:
                done.add(name)
            elif plan.reads:
                hub.progress(0, p.Progress(name=name, model="policy", version=1, chunks=[r.chunk for r in plan.reads]))
    assert done == {"w0", "w1", "w2"}
    assert hub.counters["bytes_planned.level.remote"] == 6 * 1024


def test_unpublish_waits_for_pins_and_takes_no_new_reads():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("b", node="n2"))
    publish(hub, 0, "t", 1, manifest(4))
    fetch_all(hub, 0, "a", "policy", 1)
    plan = hub.plan(0, p.Plan(name="b", model="policy", version=1, window=4))
    pinned_on_a = [r.chunk for r in plan.reads if r.source == "a"]
    assert pinned_on_a
    assert hub.unpublish(0, p.Unpublish(name="a", model="policy", version=1)) is None
    assert acks(hub.take_outbound()) == []
    again = hub.plan(0, p.Plan(name="b", model="policy", version=1, window=8))
    new = [r for r in again.reads if r.chunk not in pinned_on_a]
    assert all(r.source != "a" for r in new)
    hub.progress(0, p.Progress(name="b", model="policy", version=1, chunks=pinned_on_a))
    assert [(a.endpoint, a.ok) for a in acks(hub.take_outbound())] == [("a", True)]
    assert "a" not in hub.models["policy"][1].replicas


def test_unpublish_of_last_retained_copy_pulls_to_an_agent_first():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=1)})
    reg(hub, 0, info("t", node="n0"), info("agent-n1", node="n1", kind="agent"), info("r", node="n2", reliable=False))
    publish(hub, 0, "t", 1, manifest(4))
    assert hub.take_outbound() == []  # t is a reliable complete copy
    hub.unpublish(0, p.Unpublish(name="t", model="policy", version=1))
    out = hub.take_outbound()
    assert acks(out) == [] and [(s.endpoint, s.body.version) for s in sends(out)] == [("agent-n1", 1)]
    blocked = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4))
    assert blocked.reads == [] and blocked.waiting == 4  # readers may not read the draining copy
    fetch_all(hub, 0, "agent-n1", "policy", 1)  # the retention pull may
    assert [a.endpoint for a in acks(hub.take_outbound())] == ["t"]
    assert state(hub, 1) == "READY" and hub.models["policy"][1].complete("agent-n1")


def test_a_draining_replica_cannot_fetch_and_an_agent_letting_go_stops_pulling():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=1)})
    reg(hub, 0, info("t0", node="n0"), info("t1", node="n0"), info("agent-n1", node="n1", kind="agent"))
    publish(hub, 0, "t0", 1, manifest(2), rank=0, world=2)
    publish(hub, 0, "t1", 1, manifest(2, salt=1), rank=1, world=2)
    # Two shards, no complete reliable copy: the agent is asked for one.
    assert [s.endpoint for s in sends(hub.take_outbound())] == ["agent-n1"]
    plan = hub.plan(0, p.Plan(name="agent-n1", model="policy", version=1, window=1))
    hub.progress(0, p.Progress(name="agent-n1", model="policy", version=1, chunks=[r.chunk for r in plan.reads]))
    hub.unpublish(0, p.Unpublish(name="agent-n1", model="policy", version=1))
    # The only agent gave its copy up: nobody is left to pull, so the drain completes.
    assert [a.endpoint for a in acks(hub.take_outbound())] == ["agent-n1"]
    # Once its drain is over it is a candidate like any other, and the version is still short.
    reg(hub, 1, info("agent-n2", node="n2", kind="agent"))
    asked = [s.endpoint for s in sends(hub.take_outbound())]
    assert asked == ["agent-n1"]
    hub.plan(1, p.Plan(name="agent-n1", model="policy", version=1, window=1))
    hub.unpublish(1, p.Unpublish(name="agent-n1", model="policy", version=1))
    assert [s.endpoint for s in sends(hub.take_outbound())] == ["agent-n2"]  # the pull moves on
    with pytest.raises(HubFault) as exc:
        hub.plan(1, p.Plan(name="agent-n1", model="policy", version=1))
    assert exc.value.code == "draining" and "agent-n1 is unpublishing policy@1" in exc.value.message


def test_a_drain_waits_when_a_dropped_newer_version_moves_its_version_into_keep_latest():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=1)})
    reg(hub, 0, info("t1", node="n1"), info("t2a", node="n2"), info("t2b", node="n3"), info("x", node="n4"),
        info("agent-n5", node="n5", kind="agent"))
    publish(hub, 0, "t1", 1, manifest(2))
    # x reads v1 from t1, so v1 stays pinned (not dropped) when v2 pushes it out of keep_latest=1
    assert {r.source for r in hub.plan(0, p.Plan(name="x", model="policy", version=1, window=1)).reads} == {"t1"}
    publish(hub, 0, "t2a", 2, manifest(1, salt=2), rank=0, world=2)
    publish(hub, 0, "t2b", 2, manifest(1, salt=3), rank=1, world=2)
    hub.take_outbound()  # v2 (two shards, no complete copy) asked the agent for one
    reads = hub.plan(0, p.Plan(name="x", model="policy", version=2, window=2)).reads
    assert {r.source for r in reads} == {"t2a", "t2b"}
    hub.unpublish(0, p.Unpublish(name="t1", model="policy", version=1))  # v1 is not retained now
    hub.unpublish(0, p.Unpublish(name="t2b", model="policy", version=2))
    assert acks(hub.take_outbound()) == []  # both wait for x's pins
    # x and t2a die in one sweep: v2 loses shard 0, so no copy of it can be made; t2b's
    # drain ends, v2 is forgotten, and v1 is the latest again. Its last copy, on t1, may
    # now go only once an agent has made another.
    for name in ("t1", "t2b", "agent-n5"):
        hub.heartbeat(EXPIRY, p.Heartbeat(name=name))
    assert sorted(hub.expire(EXPIRY + 1)) == ["t2a", "x"]
    out = hub.take_outbound()
    assert [a.endpoint for a in acks(out)] == ["t2b"] and 2 not in hub.models["policy"]
    assert ("agent-n5", 1) in [(s.endpoint, s.body.version) for s in sends(out)]
    fetch_all(hub, EXPIRY + 1, "agent-n5", "policy", 1)
    assert [a.endpoint for a in acks(hub.take_outbound())] == ["t1"]

def test_unpublish_without_any_agent_still_completes():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=1)})
    reg(hub, 0, info("t"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.unpublish(0, p.Unpublish(name="t", model="policy", version=1))
    assert [a.endpoint for a in acks(hub.take_outbound())] == ["t"]
    assert 1 not in hub.models["policy"]  # nobody holds it: forgotten


def test_expired_holder_masks_failure_then_unavailable_then_back():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("r", node="n2"))
    publish(hub, 0, "t", 1, manifest(4))
    hub.plan(0, p.Plan(name="a", model="policy", version=1, window=4))
    hub.progress(0, p.Progress(name="a", model="policy", version=1, chunks=[0, 1]))
    hub.cancel(0, p.Cancel(name="a", model="policy", version=1))  # t sends 2, 3 to nobody now
    plan = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4))
    assert any(r.source == "t" for r in plan.reads)
    for n in ("a", "r"):
        hub.heartbeat(4, p.Heartbeat(name=n))
    assert hub.expire(6) == ["t"]
    assert state(hub, 1) == "UNAVAILABLE"
    with pytest.raises(HubFault) as exc:
        hub.plan(6, p.Plan(name="r", model="policy", version=1))
    assert exc.value.code == "unavailable" and exc.value.missing == [2, 3] and "policy@1" in exc.value.message
    holding = p.Holding(model="policy", version=1, world=1, shards=[manifest(4)], rank=0)
    reg(hub, 6, info("t", node="n0", pid=2), holdings=[holding])
    assert state(hub, 1) == "READY"
    plan = hub.plan(6, p.Plan(name="r", model="policy", version=1, window=4))
    assert {r.source for r in plan.reads} <= {"t", "a"} and plan.reads


def test_reads_onto_a_silent_source_are_replanned_at_the_next_poll_before_any_sweep():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("r", node="n2"))
    publish(hub, 0, "t", 1, manifest(4))
    fetch_all(hub, 0, "a", "policy", 1)
    hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4))
    hub.cancel(0, p.Cancel(name="r", model="policy", version=1))
    hub.deregister(0, p.Deregister(name="a"))  # so every read goes to t...
    first = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4))
    assert {x.source for x in first.reads} == {"t"}
    holding = p.Holding(model="policy", version=1, world=1, shards=[manifest(4)], held=[0, 1, 2, 3])
    reg(hub, 1, info("a", node="n1", pid=2), holdings=[holding])  # ...then a is back, complete
    for n in ("a", "r"):
        hub.heartbeat(EXPIRY + 0.5, p.Heartbeat(name=n))
    # t is past its expiry but no sweep has run: the very next poll moves its reads to a.
    again = hub.plan(EXPIRY + 1, p.Plan(name="r", model="policy", version=1, window=4))
    assert {x.source for x in again.reads} == {"a"} and len(again.reads) == 4
    assert hub.models["policy"][1].pins.get("t", 0) == 0

def test_hub_restart_rebuilds_from_holdings_and_keeps_drains_safe():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("r", node="n1"))
    publish(hub, 0, "t", 1, manifest(4))
    plan = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=2))
    hub.progress(0, p.Progress(name="r", model="policy", version=1, chunks=[plan.reads[0].chunk]))
    reading = [r for r in hub.plan(0, p.Plan(name="r", model="policy", version=1, window=2)).reads]
    held = [plan.reads[0].chunk]

    fresh = new_hub(now=100.0, grace_s=EXPIRY)
    with pytest.raises(HubFault) as exc:
        fresh.heartbeat(100, p.Heartbeat(name="t"))
    assert exc.value.code == "unknown_endpoint"
    reg(fresh, 100, info("t", node="n0"),
        holdings=[p.Holding(model="policy", version=1, world=1, shards=[manifest(4)], rank=0)])
    fresh.unpublish(100, p.Unpublish(name="t", model="policy", version=1))
    reg(fresh, 101, info("r", node="n1"), holdings=[p.Holding(model="policy", version=1, world=1,
                                                             shards=[manifest(4)], held=held, reading=reading)])
    assert state(fresh, 1) == "READY"
    assert fresh.models["policy"][1].pins == {"t": len(reading)}
    fresh.settle(100 + EXPIRY + 1)
    assert acks(fresh.take_outbound()) == []  # r's re-registered reads still pin t
    fresh.progress(106, p.Progress(name="r", model="policy", version=1, chunks=[r.chunk for r in reading]))
    assert [a.endpoint for a in acks(fresh.take_outbound())] == ["t"]


def test_a_replica_the_restarted_hub_saw_begin_drains_within_the_grace_period():
    # Only a rebuilt replica can have reads the hub does not know of (readers that have
    # not re-registered yet): one published after the start drains at once.
    fresh = new_hub(now=100.0, grace_s=EXPIRY)
    reg(fresh, 100, info("t", node="n0"), info("r", node="n1"),
        holdings=[p.Holding(model="policy", version=1, world=1, shards=[manifest(4)], rank=0)])
    publish(fresh, 100, "t", 2, manifest(4))
    fetch_all(fresh, 100, "r", "policy", 2)
    fresh.unpublish(101, p.Unpublish(name="r", model="policy", version=2))
    fresh.unpublish(101, p.Unpublish(name="t", model="policy", version=2))
    fresh.unpublish(101, p.Unpublish(name="t", model="policy", version=1))
    fresh.settle(101)
    assert sorted((a.endpoint, a.version) for a in acks(fresh.take_outbound())) == [("r", 2), ("t", 2)]
    fresh.settle(100 + EXPIRY + 1)
    assert [(a.endpoint, a.version) for a in acks(fresh.take_outbound())] == [("t", 1)]  # rebuilt: after the grace


def test_star_planner_reads_only_from_publishers():
    hub = new_hub(planner="star")
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("b", node="n1"))
    publish(hub, 0, "t", 1, manifest(4))
    fetch_all(hub, 0, "a", "policy", 1)
    plan = hub.plan(0, p.Plan(name="b", model="policy", version=1, window=4))
    assert {r.source for r in plan.reads} == {"t"}


def test_star_planner_counts_bytes_at_their_true_topology_level():
    """The baseline ignores topology when it chooses, not when it counts: bytes_by_level
    of a star run compare with ours."""
    hub = new_hub(planner="star")
    reg(hub, 0, info("t", node="n0", dc="dc1"), info("far", node="n5", rack="r9", dc="dc2"))
    publish(hub, 0, "t", 1, manifest(4))
    hub.plan(0, p.Plan(name="far", model="policy", version=1, window=4))
    assert hub.counters["bytes_planned.level.remote"] == 4 * 1024
    assert "bytes_planned.level.node" not in hub.counters


def test_versions_past_keep_latest_are_dropped_when_unpinned():
    hub = new_hub(policies={"policy": Policy(keep_latest=2, min_reliable_copies=0)})
    reg(hub, 0, info("t"), info("r", node="n2"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.plan(0, p.Plan(name="r", model="policy", version=1, window=1))  # pins v1
    publish(hub, 0, "t", 2, manifest(2, salt=2))
    publish(hub, 0, "t", 3, manifest(2, salt=3))
    assert sorted(hub.models["policy"]) == [1, 2, 3]  # v1 pinned: kept
    hub.cancel(0, p.Cancel(name="r", model="policy", version=1))
    publish(hub, 0, "t", 4, manifest(2, salt=4))
    assert sorted(hub.models["policy"]) == [3, 4]


def test_failed_read_is_replanned_on_another_source():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("bad", node="n1"), info("r", node="n1"))
    publish(hub, 0, "t", 1, manifest(2))
    fetch_all(hub, 0, "bad", "policy", 1)
    plan = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=1))
    assert plan.reads[0].source == "bad"  # same node: cheapest
    hub.progress(0, p.Progress(name="r", model="policy", version=1, chunks=[], failed=plan.reads))
    again = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=1))
    assert again.reads[0].source == "t" and hub.counters["reads_failed"] == 1


def test_progress_with_bad_chunk_ids_changes_nothing():
    hub = new_hub()
    reg(hub, 0, info("t"), info("r"))
    publish(hub, 0, "t", 1, manifest(2))
    with pytest.raises(HubFault, match="out of range"):
        hub.progress(0, p.Progress(name="r", model="policy", version=1, chunks=[0, 7]))
    with pytest.raises(HubFault, match=r"out of range 0\.\.1: \[-1\]"):
        hub.progress(0, p.Progress(name="r", model="policy", version=1, chunks=[0, -1]))
    with pytest.raises(HubFault, match=r"out of range 0\.\.1: \[9\]"):  # a bitset report, chunk 9 past the end
        hub.plan(0, p.Plan(name="r", model="policy", version=1, schedule=True, held=p.bitset(0b1000000001)))
    assert "r" not in hub.models["policy"][1].replicas
    hub.plan(0, p.Plan(name="r", model="policy", version=1, schedule=True, held=p.bitset(0b11)))
    assert hub.models["policy"][1].replicas["r"].held == 0b11  # reported as a bitset: held


def test_second_live_process_cannot_take_a_name():
    hub = new_hub()
    reg(hub, 0, info("t", pid=1))
    with pytest.raises(HubFault, match="held by a live endpoint"):
        hub.register(1, p.Register(info=info("t", pid=2)))


def test_a_busy_near_holder_makes_a_reader_wait_not_cross_to_a_dearer_level():
    """Contract 8 with the per-source cap: cost before load, even when the cheap
    holder is full. h (same DC as r) is at its cap serving s1, s2; x in another DC
    holds the same chunks and is idle; r must get nothing from x."""
    hub = new_hub()
    reg(hub, 0, info("t", node="n0", dc="west"), info("x", node="n1", dc="west"),
        info("h", node="n2", rack="r2"), info("s1", node="n3"), info("s2", node="n4"), info("r", node="n5"))
    publish(hub, 0, "t", 1, manifest(8))
    fetch_all(hub, 0, "x", "policy", 1)
    fetch_all(hub, 0, "h", "policy", 1)
    hub.plan(0, p.Plan(name="s1", model="policy", version=1, window=2))
    hub.plan(0, p.Plan(name="s2", model="policy", version=1, window=2))
    assert hub.load["h"] == 4  # its cap, shared by two readers
    assert hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4)).reads == []


def test_inside_a_dc_a_busy_rack_holder_lets_a_reader_read_from_another_rack():
    """Contract 8 inside a DC: cost first, but a full cheaper holder does not make the
    reader idle while an idle holder in another rack of its DC has the chunks."""
    hub = new_hub()
    reg(hub, 0, info("t", node="n0", rack="r0"), info("y", node="n1", rack="r3"),
        info("h", node="n2"), info("s1", node="n3"), info("s2", node="n4"), info("r", node="n5"))
    publish(hub, 0, "t", 1, manifest(8))
    fetch_all(hub, 0, "y", "policy", 1)
    fetch_all(hub, 0, "h", "policy", 1)
    hub.plan(0, p.Plan(name="s1", model="policy", version=1, window=2))
    hub.plan(0, p.Plan(name="s2", model="policy", version=1, window=2))
    assert hub.load["h"] == 4  # at its cap: r's rack-local holder is full
    assert set(_per_source(hub.plan(0, p.Plan(name="r", model="policy", version=1, window=4)))) == {"y"}


def test_the_publisher_sends_into_a_dc_only_chunks_no_reader_there_holds():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), *[info(n, node=f"n{i + 1}") for i, n in enumerate(("a", "a2", "b", "s1", "s2"))],
        info("w", node="n9", dc="west"))
    publish(hub, 0, "t", 1, manifest(8))
    fetch_all(hub, 0, "a", "policy", 1)
    fetch_all(hub, 0, "a2", "policy", 1)
    for s in ("s1", "s2"):
        assert set(_per_source(hub.plan(0, p.Plan(name=s, model="policy", version=1, window=4)))) <= {"a", "a2"}
    assert hub.load["a"] == hub.load["a2"] == 4  # both full; t is idle and holds every chunk b needs
    assert hub.plan(0, p.Plan(name="b", model="policy", version=1, window=8)).reads == []  # waits for them
    # Another DC: no reader there holds anything, so t sends (one copy crosses).
    assert set(_per_source(hub.plan(0, p.Plan(name="w", model="policy", version=1, window=2)))) == {"t"}
    # Once a reader failed on holders, the publisher may send it anything again (contract 5).
    for s in ("s1", "s2", "w"):
        hub.cancel(1.0, p.Cancel(name=s, model="policy", version=1))
    b = hub.plan(1.0, p.Plan(name="b", model="policy", version=1, window=8))
    assert set(_per_source(b)) == {"a", "a2"}
    hub.progress(1.0, p.Progress(name="b", model="policy", version=1, chunks=[], failed=b.reads))
    retry = hub.plan(1.0, p.Plan(name="b", model="policy", version=1, window=8))
    assert _per_source(retry) == {"t": 8}  # trusted before the readers that failed it


def test_the_publisher_serves_the_last_chunks_one_reader_holds_once_nothing_fresh_is_left():
    """No tail: while the publisher has a chunk no reader holds, it sends only such
    chunks; once it has none, its idle link serves chunks whose relaying hangs on a
    single busy reader."""
    hub = new_hub()  # max_reads_per_source = 4
    reg(hub, 0, info("t", node="n0"), *[info(n, node=f"n{i + 1}") for i, n in enumerate(("a", "b", "s1", "s2"))])
    publish(hub, 0, "t", 1, manifest(8))
    first = hub.plan(0, p.Plan(name="a", model="policy", version=1, window=4))
    half = {r.chunk for r in first.reads}
    hub.progress(0, p.Progress(name="a", model="policy", version=1, chunks=sorted(half)))
    for s in ("s1", "s2"):
        assert set(_per_source(hub.plan(0, p.Plan(name=s, model="policy", version=1, window=2)))) == {"a"}
    assert hub.load["a"] == 4  # a is full
    b = hub.plan(1.0, p.Plan(name="b", model="policy", version=1, window=8))  # (a asked t too long ago to share it)
    assert set(_per_source(b)) == {"t"} and not {r.chunk for r in b.reads} & half  # fresh chunks only
    # b reports the rest: every chunk has left t once, and a alone holds what b lacks
    more = hub.plan(1.0, p.Plan(name="b", model="policy", version=1, window=8, chunks=[r.chunk for r in b.reads]))
    assert {r.chunk for r in b.reads} | half == set(range(8))
    tail = {r.chunk for r in more.reads if r.source == "t"} & half
    assert tail, "t idles while a, the one reader holding them, is full"


def test_a_reader_that_reports_and_replans_cannot_keep_every_slot_a_waiter_asked_for():
    """Fair shares: the reader whose read finished is first to ask again, but another
    reader that asked lately gets its share of the freed slot."""
    hub = new_hub()  # max_reads_per_source = 4
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("b", node="n2"))
    publish(hub, 0, "t", 1, manifest(16))
    first = hub.plan(0, p.Plan(name="a", model="policy", version=1, window=4))
    assert _per_source(first) == {"t": 4}
    assert hub.plan(0.01, p.Plan(name="b", model="policy", version=1, window=4)).reads == []  # t is full
    done = [r.chunk for r in first.reads[:2]]
    again = hub.plan(0.02, p.Plan(name="a", model="policy", version=1, window=4, chunks=done))
    assert _per_source(again).get("t", 0) == 2  # a keeps its share (2 of 4), takes none of the freed slots
    b = hub.plan(0.03, p.Plan(name="b", model="policy", version=1, window=4))
    assert _per_source(b).get("t", 0) == 2
    # Long after b last asked, a alone may fill t again.
    hub.progress(1.0, p.Progress(name="b", model="policy", version=1, chunks=[r.chunk for r in b.reads]))
    hub.cancel(1.0, p.Cancel(name="b", model="policy", version=1))
    late = hub.plan(1.0, p.Plan(name="a", model="policy", version=1, window=4,
                                chunks=[r.chunk for r in again.reads if r.source == "t"]))
    assert _per_source(late).get("t", 0) == 4 - _per_source(late).get("b", 0)


def test_bytes_from_publishers_are_counted_per_reader_and_by_reliability():
    """The trainer's send counter: what each reader was planned from publishers."""
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("s", node="n2", reliable=False))
    publish(hub, 0, "t", 1, manifest(4))
    a = hub.plan(0, p.Plan(name="a", model="policy", version=1, window=8))
    assert {r.source for r in a.reads} == {"t"}
    hub.progress(0.1, p.Progress(name="a", model="policy", version=1, chunks=[r.chunk for r in a.reads]))
    hub.plan(0.2, p.Plan(name="s", model="policy", version=1, window=8))
    nbytes = sum(c.nbytes for c in manifest(4).chunks)
    eps = {e.name: e for e in hub.status(0.2).endpoints}
    assert eps["a"].bytes_from_publishers == eps["a"].bytes_planned == nbytes
    assert eps["s"].bytes_planned > 0 and eps["s"].bytes_from_publishers == 0  # a relays to the spot reader
    assert hub.counters["bytes_planned.from_publishers.reliable"] == nbytes
    assert "bytes_planned.from_publishers.spot" not in hub.counters


# --- an operator's withdrawal (th unpublish): contract 3's drain, retention set aside ---


def answers(out):
    from tensorhub_cli.hub.machine import Answered

    return [e.body for e in out if isinstance(e, Answered)]


def withdraw(hub, now, version, node="", timeout_s=60.0, model="policy"):
    return hub.withdraw(now, p.Withdraw(model=model, version=version, node=node, timeout_s=timeout_s))


def test_withdraw_drains_every_holder_readers_first_and_copies_nothing():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=1)})
    reg(hub, 0, info("t", node="n0"), info("a", node="n1"), info("b", node="n2"),
        info("agent-n3", node="n3", kind="agent"))
    publish(hub, 0, "t", 1, manifest(4))
    fetch_all(hub, 0, "a", "policy", 1)
    reading = hub.plan(0, p.Plan(name="b", model="policy", version=1, window=4)).reads
    sources = {r.source for r in reading}
    assert reading and sources <= {"t", "a"}
    hub.take_outbound()
    assert withdraw(hub, 0, 1) is None
    out = hub.take_outbound()
    told = sorted(s.endpoint for s in sends(out, action="unpublish"))
    assert told == ["a", "b", "t"] and sends(out, action="retain") == []  # no copy of a withdrawn version
    assert answers(out) == []  # b still reads from its sources; b's own reads are in flight too
    assert sources <= set(hub.models["policy"][1].replicas)
    with pytest.raises(HubFault) as exc:  # no new reads into (or from) a withdrawn replica
        hub.plan(0, p.Plan(name="b", model="policy", version=1, window=4))
    assert exc.value.code == "draining"
    hub.cancel(0, p.Cancel(name="b", model="policy", version=1))  # b's fetch aborts on that
    out = hub.take_outbound()
    assert answers(out) == [p.Withdrawn(model="policy", version=1, endpoints=["a", "b", "t"])]
    assert sends(out, action="retain") == [] and 1 not in hub.models["policy"]  # its last copy was not held back
    assert [e.kind for e in hub.events][-2:] == ["unpublished", "withdrawn"]


def test_a_version_being_withdrawn_resolves_neither_by_number_nor_as_latest():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("r", node="n1"), info("b", node="n2"))
    publish(hub, 0, "t", 1, manifest(2))
    publish(hub, 0, "t", 2, manifest(2))
    assert hub.plan(0, p.Plan(name="b", model="policy", version=2, window=1)).reads  # keeps v2 draining
    withdraw(hub, 0, 2)
    assert hub.models["policy"][2].state == "READY"  # still held while its drain goes on
    assert hub.resolve(0, p.Resolve(name="r", model="policy")).version == 1
    with pytest.raises(HubFault) as exc:
        hub.resolve(0, p.Resolve(name="r", model="policy", version=2))
    assert exc.value.code == "not_found" and "withdrawn" in str(exc.value)


def test_withdraw_from_one_node_keeps_retention_and_copies_off_that_node():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=1)})
    reg(hub, 0, info("t", node="n0"), info("agent-n0", node="n0", kind="agent"),
        info("agent-n1", node="n1", kind="agent"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.take_outbound()
    withdraw(hub, 0, 1, node="n0")
    out = hub.take_outbound()
    assert [s.endpoint for s in sends(out, action="unpublish")] == ["t"]
    assert [s.endpoint for s in sends(out, action="retain")] == ["agent-n1"]  # not agent-n0: it is being cleared
    assert answers(out) == []  # the last copy waits for the retained one (contract 4)
    fetch_all(hub, 0, "agent-n1", "policy", 1)
    out = hub.take_outbound()
    assert answers(out) == [p.Withdrawn(model="policy", version=1, endpoints=["t"])]
    v = hub.models["policy"][1]
    assert v.state == "READY" and set(v.replicas) == {"agent-n1"} and not hub.withdrawals


def test_withdraw_times_out_naming_who_holds_it_and_its_drains_go_on():
    hub = new_hub(policies={"policy": Policy(keep_latest=2, min_reliable_copies=1)})
    reg(hub, 0, info("t", node="n0"), info("r", node="n1"), info("agent-n2", node="n2", kind="agent"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.plan(0, p.Plan(name="r", model="policy", version=1, window=1))
    hub.take_outbound()
    withdraw(hub, 0, 1, timeout_s=10.0)
    assert answers(hub.take_outbound()) == []
    hub.settle(9.0)
    assert answers(hub.take_outbound()) == []
    for name in ("t", "r", "agent-n2"):
        hub.heartbeat(10.0, p.Heartbeat(name=name))
    hub.settle(10.0)
    (err,) = answers(hub.take_outbound())
    assert err.code == "timeout" and "policy@1 is still held after 10s by" in err.message
    assert "t (1 read(s) from it in flight)" in err.message and "r (1 read(s) of its own in flight)" in err.message
    # Told once; the withdrawal stays: still no copy is made, and once the reader lets
    # go the version is gone without a second answer.
    hub.settle(11.0)
    out = hub.take_outbound()
    assert answers(out) == [] and sends(out, action="retain") == []
    hub.cancel(11.0, p.Cancel(name="r", model="policy", version=1))
    out = hub.take_outbound()
    assert answers(out) == [] and 1 not in hub.models["policy"] and not hub.withdrawals


def test_withdraw_asked_again_gets_the_same_answer_and_a_version_nobody_holds_goes_at_once():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("r", node="n1"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.plan(0, p.Plan(name="r", model="policy", version=1, window=1))  # pins t
    withdraw(hub, 0, 1, timeout_s=5.0)
    withdraw(hub, 1, 1, timeout_s=30.0)  # the later deadline holds for both callers
    hub.settle(6.0)
    assert answers(hub.take_outbound()) == []
    # t dies: its replica goes with it, and so do r's reads from it, the last thing r's drain waited for
    hub.heartbeat(6.0, p.Heartbeat(name="r"))
    assert hub.expire(6.0) == ["t"]
    (done,) = answers(hub.take_outbound())
    assert done.endpoints == ["r", "t"] and 1 not in hub.models.get("policy", {})
    # An UNAVAILABLE version (its holders gone) is cleared by a withdrawal too
    reg(hub, 7.0, info("t2", node="n0", pid=2))
    publish(hub, 7.0, "t2", 2, manifest(1))
    hub.models["policy"][2].replicas.clear()
    hub.models["policy"][2].refresh()
    withdraw(hub, 7.0, 2)
    assert answers(hub.take_outbound()) == [p.Withdrawn(model="policy", version=2)]
    assert 2 not in hub.models["policy"]


@pytest.mark.parametrize("op, code, needle", [
    (p.Withdraw(model="policy", version=9), "not_found", "policy@9 is not known"),
    (p.Withdraw(model="my policy", version=1), "bad_request", "model 'my policy' is not a valid model name"),
    (p.Withdraw(model="policy", version=1, node="n7"), "not_found", "no endpoint on node 'n7' holds policy@1 "
                                                                    "(held on: n0)"),
    (p.Withdraw(model="policy", version=1, timeout_s=0), "bad_request", "timeout_s must be in"),
])
def test_withdraw_refusals_name_the_problem_and_change_nothing(op, code, needle):
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"))
    publish(hub, 0, "t", 1, manifest(2))
    hub.take_outbound()
    with pytest.raises(HubFault) as exc:
        hub.withdraw(0, op)
    assert exc.value.code == code and needle in exc.value.message
    assert not hub.take_outbound() and not hub.withdrawals and not hub.models["policy"][1].draining


def test_publish_refuses_a_bad_model_name_and_a_version_being_withdrawn():
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("r", node="n1"))
    with pytest.raises(HubFault) as exc:
        publish(hub, 0, "t", 1, manifest(2), model="my policy")
    assert exc.value.code == "bad_request"
    assert "model 'my policy' is not a valid model name" in exc.value.message and "[A-Za-z0-9]" in exc.value.message
    assert hub.models == {}
    publish(hub, 0, "t", 1, manifest(2, salt=1), rank=0, world=2)
    withdraw(hub, 0, 1)  # one shard of two is in: a STAGING version goes too
    assert 1 not in hub.models["policy"]  # its only publisher let go: nothing to wait for
    publish(hub, 0, "t", 2, manifest(1))
    hub.plan(0, p.Plan(name="r", model="policy", version=2, window=1))  # pins t: the withdrawal waits
    withdraw(hub, 0, 2)
    with pytest.raises(HubFault) as exc:
        publish(hub, 0, "r", 2, manifest(1))
    assert exc.value.code == "conflict" and "being withdrawn" in exc.value.message


def test_a_plan_with_want_plans_pins_and_completes_only_those_chunks():
    """A collective member reads its stripe (``Plan.want``, endpoint/collective.py):
    only wanted chunks are planned and pinned, and the plan is complete once they are
    held, though the replica is still partial."""
    hub = new_hub()
    reg(hub, 0, info("t", node="n0"), info("r", node="n1"))
    publish(hub, 0, "t", 1, manifest(6))
    want = (1 << 1 | 1 << 4).to_bytes(1, "little")
    planned = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=8, want=want))
    assert sorted(r.chunk for r in planned.reads) == [1, 4] and not planned.complete
    assert hub.models["policy"][1].feeds["r"] == {"t": 1 << 1 | 1 << 4}  # pinned: only those
    done = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=8, want=want, chunks=[1, 4]))
    assert done.complete and done.reads == []
    assert hub.models["policy"][1].replicas["r"].held == 1 << 1 | 1 << 4  # partial: the rest is not ours
    everything = hub.plan(0, p.Plan(name="r", model="policy", version=1, window=8))  # no want: every chunk
    assert sorted(r.chunk for r in everything.reads) == [0, 2, 3, 5] and not everything.complete


def test_resolve_leaves_out_the_manifests_of_the_very_version_the_reader_holds():
    hub = new_hub()
    reg(hub, 0.0, info("t0"), info("r"))
    hub.publish(0.0, p.Publish(name="t0", model="m", version=1, manifest=manifest(3), rank=0, world=1))
    digest = p.manifest_digest(1, [manifest(3)])
    assert hub.resolve(0.0, p.Resolve(name="r", model="m")).shards == [manifest(3)]
    assert hub.resolve(0.0, p.Resolve(name="r", model="m", known={1: digest})).shards == []
    # another manifest under the same number (published again), or another number: sent
    assert hub.resolve(0.0, p.Resolve(name="r", model="m", known={1: digest ^ 1})).shards == [manifest(3)]
    assert hub.resolve(0.0, p.Resolve(name="r", model="m", known={2: digest})).shards == [manifest(3)]
