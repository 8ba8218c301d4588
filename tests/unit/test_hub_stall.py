"""Silence is measured only while the hub listens: a gap of more than two sweep
periods in which the service ran nothing is its own stall, excused from every
endpoint's silence before an op or a sweep judges anyone; a busy hub, which listens
all along, excuses nothing, and answers heartbeats ahead of its queued ops (``take``)
so that its queue never makes a beating endpoint look silent."""

from __future__ import annotations

import pytest

from tensorhub_cli.bench.hubreplay import Clock
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.service import HubService

from .hubkit import EXPIRY, info, new_hub, reg

SWEEP = 1.0


@pytest.fixture
def rig():
    clock = Clock()
    hub = new_hub()
    service = HubService(hub, "tok", "tcp://127.0.0.1:*", clock=clock, sweep_s=SWEEP)
    reg(hub, 0.0, info("a", node="n1"), info("b", node="n2"))
    try:
        yield clock, hub, service
    finally:
        service.close()


def beat(hub, now: float, *names: str) -> None:
    for name in names:
        hub.heartbeat(now, p.Heartbeat(name=name))


def sweep_at(clock: Clock, service: HubService, now: float) -> set[str]:
    clock.now = now
    service.sweep()
    return set(service.hub.endpoints)


def status_at(clock: Clock, service: HubService, now: float) -> p.StatusReply:
    clock.now = now
    frame = p.encode(p.Request(v=p.PROTOCOL_VERSION, token="tok", rid=1, op=p.Status()))
    [(_, reply)] = service.handle(b"op", [frame])
    return p.decode_reply(reply).body


def test_a_stall_is_excused_and_silence_before_and_after_it_still_counts(rig):
    clock, hub, service = rig
    beat(hub, 1.0, "a", "b")
    assert sweep_at(clock, service, 1.0) == {"a", "b"}
    woke = 1.0 + EXPIRY + 2.0  # the loop ran nothing from 1.0 to here
    assert sweep_at(clock, service, woke) == {"a", "b"}
    assert hub.counters["stalls"] == 1 and "expiries" not in hub.counters
    assert [e.kind for e in hub.events][-1] == "stalled"
    assert all(ep.last_seen <= woke for ep in hub.endpoints.values())
    # Excused: the gap beyond one period (the loop may idle that long), 6 s. b last
    # beat at 1.0, so its silence reads one period at wake-up and passes EXPIRY
    # (EXPIRY - SWEEP) later, not at once.
    beat(hub, woke, "a")  # a's beat, queued during the stall; b died in it
    t = woke
    while t < woke + EXPIRY - SWEEP:
        t += SWEEP
        beat(hub, t, "a")
        assert sweep_at(clock, service, t) == {"a", "b"}, t
    assert sweep_at(clock, service, t + SWEEP) == {"a"}
    assert hub.counters["stalls"] == 1


def test_an_op_after_a_stall_excuses_it_before_it_judges_anyone(rig):
    clock, hub, service = rig
    sweep_at(clock, service, 1.0)
    woke = 1.0 + 3 * EXPIRY
    st = status_at(clock, service, woke)
    assert [e.alive for e in st.endpoints] == [True, True] and hub.counters["stalls"] == 1


def test_a_busy_hub_listens_all_along_and_excuses_nothing(rig):
    clock, hub, service = rig
    # Ops every 10 ms and no sweep for 2 * EXPIRY: a long batch, not a stall.
    for k in range(1, int(2 * EXPIRY / 0.01) + 1):
        status_at(clock, service, k * 0.01)
    assert sweep_at(clock, service, 2 * EXPIRY + 0.01) == set()
    assert "stalls" not in hub.counters and hub.counters["expiries"] == 2


def test_on_time_sweeps_expire_the_silent_at_once(rig):
    clock, hub, service = rig
    t = 0.0
    while t < EXPIRY:
        t += SWEEP
        beat(hub, t, "a")
        sweep_at(clock, service, t)
    assert sweep_at(clock, service, t + SWEEP) == {"a"}
    assert "stalls" not in hub.counters


def request(op, rid: int = 1) -> bytes:
    return p.encode(p.Request(v=p.PROTOCOL_VERSION, token="tok", rid=rid, op=op))


def test_beats_are_answered_ahead_of_queued_plans_so_a_long_queue_expires_nobody(rig, monkeypatch):
    clock, hub, service = rig
    plan = hub.plan

    def slow(now, op):  # each plan takes 50 ms of the hub's time
        clock.now += 0.05
        return plan(now, op)

    monkeypatch.setattr(hub, "plan", slow)
    for rid in range(1, 201):  # 10 s of plans, twice the expiry, all queued at 0
        assert service.take(b"reader", [request(p.Plan(name="b", model="m", version=1), rid)]) == []
    beat_at = sweep_due = SWEEP
    order = []
    while service.backlog:
        service.work(lambda out: order.extend(p.decode_reply(f).rid for _, f in out), slice_s=0)
        if clock.now >= beat_at:  # a beats on time; b is silent all along
            [(to, frame)] = service.take(b"a-beats", [request(p.Heartbeat(name="a"), 999)])
            assert to == b"a-beats" and isinstance(p.decode_reply(frame).body, p.Ok)
            beat_at += SWEEP
        if clock.now >= sweep_due:
            service.sweep()
            sweep_due += SWEEP
    assert order == list(range(1, 201))  # every other op keeps its order
    assert set(hub.endpoints) == {"a"} and hub.counters["expiries"] == 1 and "stalls" not in hub.counters


def test_a_refused_request_is_answered_at_once_and_never_queued(rig):
    clock, hub, service = rig
    bad = p.encode(p.Request(v=p.PROTOCOL_VERSION, token="nope", rid=7, op=p.Status()))
    [(_, frame)] = service.take(b"x", [bad])
    assert p.decode_reply(frame).body.code == "auth" and not service.backlog


def test_a_plan_is_a_heartbeat_as_of_its_arrival_and_a_fenced_one_is_none(rig):
    """Readers skip the beat due within a period of an answered plan
    (``endpoint.service``), so the hub takes a plan for a beat, stamped when it arrives
    (``take``), not when it is served; a plan of another incarnation keeps nobody alive."""
    clock, hub, service = rig
    hub.endpoints["b"].info.incarnation = "b-1"
    for now in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # a beats; b only plans (of a version nobody has)
        beat(hub, now, "a")
        clock.now = now
        assert service.take(b"b", [request(p.Plan(name="b", model="m", version=1, incarnation="b-1"), int(now))]) == []
        assert sweep_at(clock, service, now) == {"a", "b"}
    clock.now = 7.0
    service.take(b"old-b", [request(p.Plan(name="b", model="m", version=1, incarnation="b-0"), 7)])
    left = set()
    for now in (7.0, 8.0, 9.0, 10.0, 11.0, 11.5):  # (sweeps a period apart: no stall to excuse)
        beat(hub, now, "a")
        left = sweep_at(clock, service, now)
    assert left == {"a"}  # b: last heard at 6, past EXPIRY; the fenced plan at 7 did not count
