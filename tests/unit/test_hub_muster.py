"""Musters (hub/mustering.py): a new swarm's first plans within ``muster_s`` are
answered together, the readers chained by rack and node, nearest the roots first."""

from __future__ import annotations

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.faults import Answered

from .hubkit import info, manifest, new_hub, reg

MODEL = "m"


def _hub(readers, muster_s=0.05, **kw):
    """A trainer on rack "ra" and ``readers`` ((name, rack) pairs), version 1 published."""
    hub = new_hub(muster_s=muster_s, **kw)
    reg(hub, 0.0, info("t0", node="t", rack="ra", dc="dc1"))
    for name, rack in readers:
        reg(hub, 0.0, info(name, node=f"node-{name}", rack=rack, dc="dc1"))
    hub.publish(0.0, p.Publish(name="t0", model=MODEL, version=1, manifest=manifest(8), rank=0, world=1))
    return hub


def _plan(name):
    return p.Plan(name=name, model=MODEL, version=1, schedule=True)


def _answers(hub) -> dict[str, p.Planned]:
    out = {}
    for event in hub.take_outbound():
        if isinstance(event, Answered) and event.key[0] == "plan":
            out[event.key[1]] = event.body
    return out


def _parents(planned: dict[str, p.Planned]) -> dict[str, set[str]]:
    return {name: {feed.source for feed in got.feeds} for name, got in planned.items()}


def test_readers_asking_together_are_chained_by_rack_not_by_arrival():
    arrivals = [("b1", "rb"), ("a1", "ra"), ("b2", "rb"), ("a2", "ra")]  # racks interleaved
    hub = _hub(arrivals)
    for name, _ in arrivals:
        assert hub.plan(0.01, _plan(name)) is None, "a first plan waits for its swarm's muster"
    assert abs(hub.due() - 0.06) < 1e-9
    hub.muster(0.059)
    assert not _answers(hub), "nothing is answered before the muster closes"
    hub.muster(0.0601)
    got = _parents(_answers(hub))
    # the trainer's rack first, then by rack and node: t0 -> a1 -> a2 -> b1 -> b2, one crossing
    assert got == {"a1": {"t0"}, "a2": {"a1"}, "b1": {"a2"}, "b2": {"b1"}}, got
    assert [e.message for e in hub.events if e.kind == "muster"] == ["dc1: 4 reader(s) joined in order: a1 a2 b1 b2"]
    assert hub.due() is None


def test_a_reader_after_the_muster_goes_behind_the_tail_at_once():
    hub = _hub([("a1", "ra"), ("b1", "rb"), ("a2", "ra")])
    assert hub.plan(0.0, _plan("b1")) is None
    hub.muster(0.05)
    assert _parents(_answers(hub)) == {"b1": {"t0"}}
    late = hub.plan(0.2, _plan("a1"))
    assert late is not None and {f.source for f in late.feeds} == {"b1"}


def test_later_plans_and_unscheduled_plans_are_never_parked():
    hub = _hub([("a1", "ra"), ("a2", "ra")])
    windowed = hub.plan(0.0, p.Plan(name="a2", model=MODEL, version=1, window=4))
    assert windowed is not None and windowed.reads
    assert hub.plan(0.0, _plan("a1")) is None
    hub.muster(0.05)
    assert "a1" in _answers(hub)
    again = hub.plan(0.1, p.Plan(name="a1", model=MODEL, version=1, schedule=True, chunks=[0]))
    assert again is not None, "a member's report is answered at once"


def test_a_parked_reader_that_expired_is_answered_with_its_refusal():
    hub = _hub([("a1", "ra"), ("a2", "ra")], muster_s=6.0)  # (longer than the expiry, for the test)
    assert hub.plan(0.0, _plan("a1")) is None
    assert hub.plan(0.0, _plan("a2")) is None
    hub.heartbeat(4.0, p.Heartbeat(name="a2"))
    hub.heartbeat(4.0, p.Heartbeat(name="t0"))
    hub.expire(6.0)  # a1 fell silent while parked
    hub.muster(6.0)
    got = _answers(hub)
    assert isinstance(got["a1"], p.Error) and got["a1"].code == "unknown_endpoint", got["a1"]
    assert {f.source for f in got["a2"].feeds} == {"t0"}


def test_muster_zero_answers_every_plan_at_once():
    hub = _hub([("a1", "ra")], muster_s=0.0)
    assert hub.plan(0.0, _plan("a1")) is not None
    assert hub.due() is None


def test_with_chains_side_by_side_each_chain_gets_a_run_of_neighbours():
    hub = new_hub(muster_s=0.05)
    for r in range(2):  # two ranks on rack "ra", each half of the want: two chains
        reg(hub, 0.0, info(f"t{r}", node=f"t{r}", rack="ra", dc="dc1"))
    arrivals = [("b1", "rb"), ("a1", "ra"), ("b2", "rb"), ("a2", "ra")]
    for name, rack in arrivals:
        reg(hub, 0.0, info(name, node=f"node-{name}", rack=rack, dc="dc1"))
    for r in range(2):
        hub.publish(0.0, p.Publish(name=f"t{r}", model=MODEL, version=1, manifest=manifest(4, salt=r + 1), rank=r,
                                   world=2))
    for name, _ in arrivals:
        assert hub.plan(0.0, _plan(name)) is None
    hub.muster(0.05)
    got = _parents(_answers(hub))
    assert got["a2"] == {"a1"} and got["b2"] == {"b1"}, got  # no chain link crosses the racks
    assert got["a1"] == got["b1"] == {"t0", "t1"}, got
