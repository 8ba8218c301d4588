"""Every wait in launch/ takes its limit from the caller: the drain grace of a leaving
endpoint from the spec (``endpoints.drain_timeout_s``, per replica it holds), the rest
from arguments with documented defaults."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.launch import cluster, launchers, operate, scale
from tensorhub_cli.launch.procs import ProcRecord
from tensorhub_cli.launch.state import ClusterState, cluster_dir, write_token

from ..conftest import REPO


def rec(role: str, node: str) -> ProcRecord:
    return ProcRecord(role=role, node=node, pid=1, starttime=1, marker="m", log="")


class Launcher:
    """Records the limit each stop was given; every stop succeeds."""

    parallel = 1

    def __init__(self):
        self.stops: list[tuple[str, float, str]] = []

    def stop(self, r: ProcRecord, timeout: float = 5.0, sig: str = "TERM") -> str:
        self.stops.append((f"{r.role}-{r.node}", timeout, sig))
        return "stopped"

    def close(self) -> None:
        pass


@pytest.fixture
def recorded_cluster(th_home):
    """A cluster's on-disk record (spec copy, token, state) with nothing running."""

    def make(endpoints: dict | None = None):
        doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
        if endpoints is not None:
            doc["endpoints"] = endpoints
        cluster_dir(doc["name"]).mkdir(parents=True, exist_ok=True)
        (cluster_dir(doc["name"]) / "spec.yaml").write_text(yaml.safe_dump(doc))
        write_token(doc["name"], None)
        state = ClusterState(cluster=doc["name"], launcher="local", hub_address="tcp://127.0.0.1:9",
                             hub_node_address="127.0.0.1", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0,
                             procs=[rec("hub", "node1"), rec("agent", "node2"), rec("rollout", "node2"),
                                    rec("rollout", "node3")])
        return doc["name"], state

    return make


def test_drain_grace_comes_from_the_spec_per_replica(recorded_cluster):
    name, state = recorded_cluster({"drain_timeout_s": 7.5})
    op = scale.Operator(name, state, log=lambda *_: None)
    try:
        assert op.drain_timeout == 7.5
        op.launcher = Launcher()
        op.status = lambda: SimpleNamespace(endpoints=[SimpleNamespace(name="rollout-node2", replicas=3),
                                                       SimpleNamespace(name="agent-node2", replicas=0)])
        op.stop([r for r in state.procs if r.role == "rollout"])
        op.stop([r for r in state.procs if r.role == "agent"], sig="USR1")
        # three replicas: three drains; an unknown or empty endpoint still gets one
        assert op.launcher.stops == [("rollout-node2", 22.5, "TERM"), ("rollout-node3", 7.5, "TERM"),
                                     ("agent-node2", 7.5, "USR1")]
    finally:
        op.close()


def test_drain_grace_defaults_and_overrides(recorded_cluster):
    name, state = recorded_cluster()
    op = scale.Operator(name, state, log=lambda *_: None)
    try:
        assert op.drain_timeout == 120.0  # a spec without `endpoints:` keeps the old grace

        def unreachable():
            raise scale.ScaleError("hub at tcp://127.0.0.1:9: unreachable")

        op.status = unreachable
        assert op.drain_grace(rec("rollout", "node2")) == 120.0
    finally:
        op.close()
    op = scale.Operator(name, state, log=lambda *_: None, drain_timeout=2.0, register_timeout=3.0,
                        call_timeout=0.5, rollback_timeout=1.0)
    try:
        assert (op.drain_timeout, op.register_timeout, op.call_timeout, op.rollback_timeout) == (2.0, 3.0, 0.5, 1.0)
    finally:
        op.close()


def test_down_gives_each_process_the_stop_timeout_given():
    state = ClusterState(cluster="x", launcher="local", hub_address="tcp://127.0.0.1:9", hub_node_address="127.0.0.1",
                         metrics_port=None, heartbeat_s=0.5, expiry_s=3.0,
                         procs=[rec("hub", "n1"), rec("agent", "n1"), rec("rollout", "n2")])
    launcher = Launcher()
    cluster.down_state(state, launcher, log=lambda *_: None, stop_timeout=0.25)
    assert [(n, t) for n, t, _ in launcher.stops] == [("rollout-n2", 0.25), ("agent-n1", 0.25), ("hub-n1", 0.25)]


class Hub:
    """A hub that accepts a sync and never completes it; records each call's limit."""

    def __init__(self):
        self.timeouts: list[float] = []

    def call(self, op, timeout: float):
        self.timeouts.append(timeout)
        if isinstance(op, p.Sync):
            return p.Synced(version=1, targets=["rollout-node2"])
        if isinstance(op, p.Events):
            return p.EventsReply(events=[])
        return p.StatusReply(cluster="x", uptime_s=1.0, counters={}, events=[],
                             endpoints=[p.EndpointStatus(name="rollout-node2", node="node2", role="rollout",
                                                         kind="runner", alive=True, heartbeat_age_s=0.0, replicas=0)],
                             versions=[p.VersionStatus(model="policy", version=1, state="READY", chunks=1, nbytes=8,
                                                       replicas=1, complete_replicas=1)])


def test_sync_uses_the_call_timeout_and_deadline_given():
    hub = Hub()
    run = operate.sync(hub, "policy", None, "rollout", None, timeout=0.2, call_timeout=0.75, poll_s=0.01)
    assert run.targets["rollout-node2"].failed == "not complete within 0s"
    assert len(hub.timeouts) >= 3 and set(hub.timeouts) == {0.75}


def test_endpoint_processes_get_the_specs_endpoint_limits(tmp_path):
    from tensorhub_cli.spec import load

    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    doc["endpoints"] = {"read_timeout_s": 12.0, "plan_timeout_s": 2.5, "drain_timeout_s": 40.0}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    spec = load(tmp_path / "s.yaml")
    assert launchers.endpoint_timeout_args(spec) == [
        "--read-timeout-s", "12.0", "--plan-timeout-s", "2.5", "--drain-timeout-s", "40.0"]
    for module in ("tensorhub_cli.agent", "runners.rollout", "runners.trainer"):
        usage = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                               cwd=REPO).stdout
        assert all(flag in usage for flag in launchers.endpoint_timeout_args(spec)[::2]), module
        assert "--ucx-net-devices" in usage, module  # `th` passes a node's ucx_net_devices to every process

