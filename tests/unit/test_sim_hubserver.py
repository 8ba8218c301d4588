"""What the simulated hub core charges: the real hub's CPU, without the cyclic
collector's full passes over the simulator's heap (``sim.hubhost.FullPasses``)."""

import gc
import time

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.machine import Hub, HubConfig
from tensorhub_cli.sim import hubhost
from tensorhub_cli.sim.events import Loop
from tensorhub_cli.sim.hubhost import FullPasses
from tensorhub_cli.sim.hubserver import HubServer


def info(name: str) -> p.EndpointInfo:
    return p.EndpointInfo(name=name, node=name, rack="r1", dc="dc1", role="rollout", pid=1, incarnation=name)


def server() -> tuple[Loop, HubServer]:
    loop = Loop()
    hub = Hub(HubConfig(cluster="sim", expiry_s=5.0, grace_s=0.0), now=0.0)
    return loop, HubServer(loop, hub, rtt_s=0.001, charge=True)


def test_a_full_pass_over_the_simulators_heap_is_not_charged_to_the_hub(monkeypatch):
    heap = [[i] for i in range(1_000_000)]  # the simulator's objects (flows, events, ...)
    t0 = time.process_time()
    gc.collect()
    full_s = time.process_time() - t0

    def register(hub, now, op):  # the real register, during which a full pass runs
        gc.collect()
        return Hub.register(hub, now, op)

    monkeypatch.setitem(hubhost._OPS, p.Register, register)
    loop, srv = server()
    srv.call(p.Register(info=info("a")), None)
    loop.run(until=1.0)
    assert "a" in srv.hub.endpoints and len(heap) == 1_000_000
    assert full_s > 0.005  # (the pass is long enough to tell apart from the register itself, ~50 µs)
    assert 0 <= srv.cpu["register"] < full_s / 4  # charged the pass, it would be about full_s
    assert srv.busy_s == pytest.approx(srv.cpu["register"])


def test_full_passes_counts_only_full_passes_and_uninstalls_itself():
    with FullPasses() as full:
        gc.collect(0)
        young = full.cpu_s
        gc.collect()
    assert young == 0.0 and full.cpu_s > 0.0
    assert full._on not in gc.callbacks


def test_a_hub_call_that_raises_leaves_no_callback_behind(monkeypatch):
    def broken(hub, now, op):
        raise RuntimeError("a bug in the hub")

    before = list(gc.callbacks)
    monkeypatch.setitem(hubhost._OPS, p.Register, broken)
    loop, srv = server()
    srv.call(p.Register(info=info("a")), None)
    with pytest.raises(RuntimeError, match="a bug in the hub"):
        loop.run(until=1.0)
    assert gc.callbacks == before
