"""The service's expiry sweep: silence the hub measured while it was not listening
(its own loop stalled) is not the endpoints' silence, but a hub that is always late
still expires the dead, at most one sweep later."""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.service import HubService

from .hubkit import EXPIRY, info, new_hub, reg

SWEEP = 1.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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


def test_a_stalled_hub_hears_the_heartbeats_queued_during_its_stall_before_it_expires(rig):
    clock, hub, service = rig
    assert sweep_at(clock, service, SWEEP) == {"a", "b"}
    # The hub's loop stops for longer than the expiry; both endpoints went on beating,
    # but their beats sit in the socket's queue until the loop runs again.
    stalled_until = SWEEP + EXPIRY + 2.0
    assert sweep_at(clock, service, stalled_until) == {"a", "b"}
    assert hub.counters["sweeps.deferred"] == 1 and "expiries" not in hub.counters
    beat(hub, stalled_until + 0.01, "a")  # what was queued: a's beat; b really died during the stall
    assert sweep_at(clock, service, stalled_until + SWEEP) == {"a"}
    assert hub.counters["expiries"] == 1


def test_a_hub_whose_every_sweep_is_late_still_expires_on_every_other_sweep(rig):
    clock, hub, service = rig
    late = 3 * SWEEP  # every sweep past the stall bound
    alive = [sweep_at(clock, service, late * k) for k in range(1, 5)]
    # a and b are silent from 0: silent past EXPIRY first at sweep 2 (t = 6), which defers
    # (sweep 1 did not, as it had nothing before it); sweep 3 (t = 9) must expire them.
    assert alive[:2] == [{"a", "b"}] * 2 and alive[2] == set()
    assert hub.counters["sweeps.deferred"] == 2  # sweeps 2 and 4: never two in a row


def test_an_on_time_sweep_expires_the_silent_at_once(rig):
    clock, hub, service = rig
    t = 0.0
    while t < EXPIRY:
        t += SWEEP
        beat(hub, t, "a")
        sweep_at(clock, service, t)
    assert sweep_at(clock, service, t + SWEEP) == {"a"}
    assert "sweeps.deferred" not in hub.counters
