"""``sim.hubhost``: the hub in a process of its own answers as the hub in this one does,
stays awake from a call until its queue runs empty (never on one core), fails loudly
(never hangs) when its process breaks, and leaves no process behind."""

import os
import signal
import time

import psutil
import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.machine import Hub, HubConfig
from tensorhub_cli.sim import workloads
from tensorhub_cli.sim.hubhost import MUSTER, SWEEP, HubHere, HubProcess
from tensorhub_cli.sim.params import SimParams
from tensorhub_cli.sim.scenario import manifests

CHUNK = 1 << 20


def info(name: str) -> p.EndpointInfo:
    return p.EndpointInfo(name=name, node=name, rack="r1", dc="dc1", role="rollout", pid=1, incarnation=name)


def fresh() -> Hub:
    return Hub(HubConfig(cluster="sim", expiry_s=5.0, grace_s=0.0, muster_s=0.0), now=0.0)


def script() -> list:
    """Register a trainer and a reader, publish, resolve, plan; beats; the reader goes
    silent and a later sweep expires it."""
    manifest = manifests(4 * CHUNK, 1, CHUNK)[0]
    return [
        (p.Register(info=info("t")), 0.0), (p.Register(info=info("r")), 0.0),
        (p.Publish(name="t", model="m", version=1, manifest=manifest), 0.1),
        (p.Resolve(name="r", model="m", version="latest"), 0.2),
        (p.Plan(name="r", model="m", version=1), 0.3),
        ([p.Heartbeat(name="t", incarnation="t")], 3.0), (SWEEP, 3.0), (MUSTER, 3.0),
        ([p.Heartbeat(name="t", incarnation="t")], 6.0), (SWEEP, 6.0),
    ]


def test_the_hub_in_its_own_process_answers_as_the_hub_here():
    here, there = HubHere(fresh()), HubProcess(fresh())
    proc = there._proc
    try:
        for entry, now in script():
            a, b = here.apply(entry, now), there.apply(entry, now)
            assert (a.body, a.answers, a.due, a.expired, a.last_seen) == (b.body, b.answers, b.due, b.expired,
                                                                          b.last_seen), entry
            assert b.cpu_s >= 0.0
        assert b.expired == ["r"]  # (the script's last sweep: the reader fell silent)
        there.heard(6.5, "t", "t")  # no reply; applied before the next call
        assert there.apply(SWEEP, 6.5).last_seen["t"] == 6.5
        assert there.counters() == here.counters() and there.counters()["plans"] == 1
    finally:
        there.close()
    assert proc.poll() == 0  # it read EOF and exited
    assert there.counters()["plans"] == 1  # the last counters outlive the process


def test_a_hub_that_fails_in_its_process_raises_with_the_childs_traceback():
    there = HubProcess(fresh())
    try:
        with pytest.raises(RuntimeError, match="(?s)failed on 'apply'.*KeyError"):
            there.apply(object(), 0.0)  # no operation of that type: a bug, as the hub's own would be
    finally:
        there.close()
    assert there._proc.poll() is not None


def test_a_hub_process_that_died_is_reported_not_waited_on():
    there = HubProcess(fresh(), timeout_s=5.0)
    try:
        os.kill(there._proc.pid, signal.SIGKILL)
        there._proc.wait(timeout=10)
        with pytest.raises(RuntimeError, match="exited"):
            there.apply(SWEEP, 1.0)
    finally:
        there.close()


def test_a_run_whose_hub_has_its_own_process_reads_what_the_run_here_reads():
    def run(own_process: bool) -> dict:
        p_ = SimParams.model_validate({
            "cluster": {"gpus": 32, "gpus_per_node": 4, "nodes_per_rack": 2},
            "roles": {"trainer_fraction": 0.25, "rollout_tp": 4}, "model": {"params": 4.0e+8, "chunk_mib": 64},
            # charged, but at no real cost: both runs then take the same simulated time
            "hub": {"charge_cpu": True, "cpu_scale": 1e-12, "own_process": own_process}})
        return workloads.standalone(p_, "ros", 4, 16, barrier=False)

    here, there = run(False), run(True)
    assert there["bytes"] == here["bytes"] > 0 and there["from_trainer_bytes"] == here["from_trainer_bytes"]
    for key in ("plans", "resolves", "chunks_reported"):
        assert there["hub_counters"].get(key) == here["hub_counters"].get(key) > 0, key
    assert there["hub_cpu_s"] > 0


def _cpu_over(proc, seconds: float) -> float:
    """CPU seconds ``proc`` used over ``seconds`` of wall time."""
    p_ = psutil.Process(proc.pid)
    before = sum(p_.cpu_times()[:2])
    time.sleep(seconds)
    return sum(p_.cpu_times()[:2]) - before


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the child spins only where two cores are ours")
def test_the_hub_process_stays_awake_from_a_call_until_idle_then_sleeps():
    there = HubProcess(fresh())
    try:
        assert _cpu_over(there._proc, 0.3) < 0.1  # started: nothing queued yet, it sleeps
        there.apply(SWEEP, 0.0)
        assert _cpu_over(there._proc, 0.5) > 0.2  # a call came: awake for the next, as a busy hub is
        there.idle()
        there.counters()  # (a round trip: the idle is taken)
        there.idle()
        assert _cpu_over(there._proc, 0.3) < 0.1
    finally:
        there.close()


def test_on_one_core_the_hub_process_never_spins():
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # (the child inherits it)
    try:
        there = HubProcess(fresh())
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        there.apply(SWEEP, 0.0)
        assert _cpu_over(there._proc, 0.3) < 0.1
    finally:
        there.close()
