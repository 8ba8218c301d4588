"""The simulated hub's core, as the service runs it: heartbeats and the sweep go ahead of
queued requests, so a burst of plans that keeps the core busy for twice the expiry
expires none of the endpoints that beat meanwhile (contract 6). In the old single
queue the sweep, queued behind the burst, judged beats that had not been served yet."""

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.machine import Hub, HubConfig
from tensorhub_cli.sim.events import Loop
from tensorhub_cli.sim.hubserver import HubServer

EXPIRY, BEAT, COST = 5.0, 1.0, 0.01  # each request keeps the core busy 10 ms


def info(name: str) -> p.EndpointInfo:
    return p.EndpointInfo(name=name, node=name, rack="r1", dc="dc1", role="rollout", pid=1, incarnation=name)


def test_a_burst_of_plans_twice_the_expiry_long_expires_none_of_the_beating():
    loop = Loop()
    hub = Hub(HubConfig(cluster="sim", expiry_s=EXPIRY, grace_s=0.0), now=0.0)
    # Only the per-request cost is charged (cpu_scale 0): the run is exact.
    server = HubServer(loop, hub, rtt_s=0.0, charge=True, cpu_scale=0.0, overhead_s=COST, sweep_s=BEAT)
    names = ["a", "b"]
    for name in names:
        server.call(p.Register(info=info(name)), None)
    server.start_sweeps()

    def beat() -> None:
        server.beats([p.Heartbeat(name=n, incarnation=n) for n in names])
        loop.after(BEAT, beat)

    def burst() -> None:  # 1,000 plans at once: 10 s of the core (nobody is "ghost")
        for _ in range(1000):
            server.call(p.Plan(name="ghost", model="m", version=1), None)

    loop.after(BEAT, beat)
    loop.at(0.5, burst)
    loop.run(until=4 * EXPIRY)
    assert server.calls["plan"] == 1000 and server.busy_s > 2 * EXPIRY  # (the burst was served)
    assert server.expired == [] and set(hub.endpoints) == {"a", "b"}
    assert server.silence_max_s <= BEAT + 2 * COST
