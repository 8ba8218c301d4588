"""The simulator driven by the real hub: closed forms, determinism, a failure re-planned.

Overheads are off (no round trip, no checksum time, hub CPU not charged), so the
answers are exact functions of sizes and rates."""

import pytest

from tensorhub_cli.sim import scenario as sc
from tensorhub_cli.sim import workloads as W
from tensorhub_cli.sim.events import Loop
from tensorhub_cli.sim.network import Network
from tensorhub_cli.sim.params import Fetch, SimParams
from tensorhub_cli.sim.topology import Fabric
from tensorhub_cli.sim.world import World

MIB = 1 << 20
S, C = 32 * MIB, 2 * MIB  # 16 chunks
GBPS = 1.0
B = GBPS * 1e9 / 8  # bytes/s of every NIC


def params(**hub) -> SimParams:
    p = SimParams()
    # (no muster either: a first plan answered at once, as the closed forms assume)
    return p.model_copy(update={"hub": p.hub.model_copy(update={"charge_cpu": False, "muster_s": 0.0, **hub})})


def world(planner: str, n: int, p: SimParams | None = None, protocol: str = "schedule", fragments: int = 1) -> World:
    fetch = Fetch(plan_rtt_s=0.0, verify_s=0.0, verify_gbps=1e9, report_s=0.0, start_jitter_s=0.0, window=4,
                  read_error_s=0.2, protocol=protocol, fragments=fragments)
    fabric = Fabric(gpus_per_node=1, nodes_per_rack=64, nic_gbps=GBPS, nvlink_gbps=100.0, rack_uplink_gbps=None,
                    wan_gbps=None)
    return World(p or params(), [n + 1], planner=planner, fetch=fetch, fabric=fabric, overhead_s=0.0, exact=True)


def fan(planner: str, n: int, kill_at: float | None = None, leave: bool = False, protocol: str = "schedule",
        fragments: int = 1):
    w = world(planner, n, protocol=protocol, fragments=fragments)
    pub = w.endpoint("pub", 0, "trainer")
    readers = [w.endpoint(f"r{i}", i + 1, "rollout") for i in range(n)]
    sc.register(w, [pub, *readers])
    t0 = sc.publish(w, [pub], "m", 1, sc.manifests(S, 1, C))
    if kill_at is not None:
        w.loop.at(t0 + kill_at, _kill_a_relay, w, readers, leave)
    fetches = sc.fetch(w, [(r, 0, t0) for r in readers], "m", 1)
    w.close()
    return w, t0, fetches


def _kill_a_relay(w: World, readers, leave: bool = False) -> None:
    """Kill (or make leave) the reader that is serving the most reads right now."""
    serving = {}
    for src, fetch, chunk in w._flows.values():
        if src.name != "pub":
            serving[src.name] = serving.get(src.name, 0) + 1
    assert serving, "no reader was relaying at the time of the failure"
    (w.leave if leave else w.kill)(max(sorted(serving), key=serving.get))


def test_one_reader_takes_size_over_rate():
    _, t0, fetches = fan("ros", 1)
    assert fetches["r0"].ended - t0 == pytest.approx(S / B, rel=1e-6)


def test_star_takes_n_times_size_over_rate():
    _, t0, fetches = fan("star", 4)
    assert max(f.ended for f in fetches.values()) - t0 == pytest.approx(4 * S / B, rel=1e-6)


def test_a_chain_pipelines_chunk_by_chunk():
    # Store-and-forward relay along a chain (reader i reads each chunk from reader i-1
    # once that one has it): S/B for the first hop, one chunk time more per hop.
    loop = Loop()
    net = Network(loop)
    n, chunks = 4, S // C
    links = [(net.link(B), net.link(B)) for _ in range(n + 1)]  # (out, in) per node
    done = [[None] * chunks for _ in range(n + 1)]
    done[0] = [0.0] * chunks
    busy = [False] * (n + 1)

    def pump(i):  # node i reads its next chunk from node i-1, one at a time
        if i > n or busy[i]:
            return
        j = next((k for k in range(chunks) if done[i][k] is None), None)
        if j is None or done[i - 1][j] is None:
            return
        busy[i] = True
        net.start([links[i - 1][0], links[i][1]], C, lambda: got(i, j))

    def got(i, j):
        done[i][j] = loop.now
        busy[i] = False
        pump(i)
        pump(i + 1)

    pump(1)
    loop.run()
    assert done[n][-1] == pytest.approx(S / B + (n - 1) * C / B, rel=1e-6)


@pytest.mark.parametrize("fragments", [1, 4])
def test_a_scheduled_chain_lags_a_relayed_fragment_per_hop(fragments):
    """One trainer feeds one chain; each member relays what lands, a fragment at a time:
    the tail ends S/B plus one fragment time per hop after the publish (a chunk time per
    hop when chunks are relayed whole)."""
    n = 4
    _, t0, fetches = fan("ros", n, fragments=fragments)
    tail = max(f.ended for f in fetches.values()) - t0
    assert tail == pytest.approx(S / B + (n - 1) * C / fragments / B, rel=1e-6)


def test_ros_relays_between_the_chain_and_the_star():
    _, t0, fetches = fan("ros", 4)
    t = max(f.ended for f in fetches.values()) - t0
    assert S / B * (1 - 1e-9) <= t
    assert t < 0.6 * 4 * S / B  # readers relay: well under the star's N·S/B
    assert sum(f.from_publishers for f in fetches.values()) < 4 * S  # not everything from the publisher


def test_same_inputs_same_run():
    p = params()
    one = W.standalone(p.model_copy(update={"model": p.model.model_copy(update={"params": 2e9, "chunk_mib": 64})}),
                       "ros", 4, 12, barrier=False)
    two = W.standalone(p.model_copy(update={"model": p.model.model_copy(update={"params": 2e9, "chunk_mib": 64})}),
                       "ros", 4, 12, barrier=False)
    for run in (one, two):
        run.pop("hub_cpu_s"), run.pop("hub_cpu"), run.pop("hub_cpu_total_s")  # measured CPU: noise
    assert one == two


@pytest.mark.parametrize("protocol", ["schedule", "window"])
def test_a_failure_mid_fanout_is_replanned(protocol):
    clean_w, t0, clean = fan("ros", 4, protocol=protocol)
    t_clean = max(f.ended for f in clean.values()) - t0
    w, t0, fetches = fan("ros", 4, kill_at=t_clean / 3, protocol=protocol)
    dead = [f for f in fetches.values() if not f.ep.alive]
    alive = [f for f in fetches.values() if f.ep.alive]
    assert len(dead) == 1 and len(alive) == 3
    assert all(f.error is None and f.finished and len(f.held) == S // C for f in alive)
    counters = w.hub.counters
    assert counters.get("reads_failed", 0) >= 1  # its reads in flight came back failed and went elsewhere
    if protocol == "window":  # windowed readers wait for the hub to expire the dead relay
        assert [name for _, name in w.hub.expired] == [dead[0].ep.name]  # contract 6: expired by the sweep
    else:  # scheduled ones re-parent on their own failed reads and waits, before any expiry
        assert max(f.ended for f in alive) < t0 + t_clean / 3 + w.params.hub.expiry_s
    assert max(f.ended for f in alive) - t0 > t_clean


@pytest.mark.parametrize("protocol", ["schedule", "window"])
def test_a_leave_mid_fanout_is_replanned_at_once(protocol):
    _, t0, clean = fan("ros", 4, protocol=protocol)
    t_clean = max(f.ended for f in clean.values()) - t0
    w, t0, fetches = fan("ros", 4, kill_at=t_clean / 3, leave=True, protocol=protocol)
    alive = [f for f in fetches.values() if f.ep.alive]
    assert len(alive) == 3 and all(f.error is None and len(f.held) == S // C for f in alive)
    gone = next(f.ep.name for f in fetches.values() if not f.ep.alive)
    assert gone not in w.hub.hub.endpoints and w.hub.expired == []  # deregistered, not expired
    if protocol == "window":  # its reads were dropped by the hub with it and re-planned: none came back as failed
        assert w.hub.counters.get("reads_failed", 0) == 0
    # (scheduled readers hear of it from the leaver itself, whose notices stop: they
    # report those waits failed and the hub re-parents them, before any expiry)
