"""`th scale` names each runner it starts uniquely per (role, node, index), gives it its
own log (and, over ssh, its own pid file), places several on a node with room for
them, and succeeds only once the name it started has registered: a start whose
process never registers under its own name is a failure, rolled back."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.launch import scale
from tensorhub_cli.launch.procs import ProcRecord
from tensorhub_cli.launch.ssh import start_command
from tensorhub_cli.launch.state import ClusterState, cluster_dir, write_token

from ..conftest import REPO


def rec(role: str, node: str, pid: int = 1) -> ProcRecord:
    return ProcRecord(role=role, node=node, pid=pid, starttime=1, marker="m", log="")


class Launcher:
    """Starts nothing: records each start; a started runner registers (or, with
    ``registers=False``, exits at once without registering)."""

    parallel = 1

    def __init__(self, op, registers: bool = True):
        self.op, self.registers = op, registers
        self.starts: list[dict] = []
        self.stopped: list[int] = []
        self.next_pid = 100

    def token_path(self, node, token) -> str:
        return "/tmp/token"

    def start(self, node, role, module, args, name=None) -> ProcRecord:
        self.next_pid += 1
        got = args[args.index("--name") + 1]
        self.starts.append({"node": node.spec.name, "name": got, "file_name": name})
        if self.registers:
            self.op.registered.add(got)
        return ProcRecord(role=role, node=node.spec.name, pid=self.next_pid, starttime=1, marker=module,
                          log=f"/logs/{name or role + '-' + node.spec.name}.log")

    def alive(self, r: ProcRecord) -> bool:
        return r.pid < 100 or self.registers

    def stop(self, r: ProcRecord, timeout: float = 5.0, sig: str = "TERM") -> str:
        self.stopped.append(r.pid)
        self.op.registered.discard(scale.endpoint_name(r))
        return "stopped"

    def log_tail(self, r: ProcRecord, lines: int = 8) -> str:
        return "conflict: endpoint name is held by a live endpoint"

    def close(self) -> None:
        pass


def endpoint(name: str, node: str, kind: str = "runner") -> p.EndpointStatus:
    return p.EndpointStatus(name=name, node=node, role=kind, kind=kind, alive=True, heartbeat_age_s=0.0, replicas=0)


@pytest.fixture
def operator(th_home):
    """An Operator over a recorded local cluster whose node2 has 2 GPUs (room for two
    runners); rollouts may run on node2 only. The hub answers from ``op.registered``."""
    made = []

    def make(runners: list[ProcRecord], registers: bool = True):
        doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
        doc["topology"]["datacenters"][0]["racks"][0]["nodes"][1]["gpus"] = 2
        doc["roles"]["rollout"]["select"] = {"nodes": ["node2"]}
        cluster_dir(doc["name"]).mkdir(parents=True, exist_ok=True)
        (cluster_dir(doc["name"]) / "spec.yaml").write_text(yaml.safe_dump(doc))
        write_token(doc["name"], None)
        state = ClusterState(cluster=doc["name"], launcher="local", hub_address="tcp://127.0.0.1:9",
                             hub_node_address="127.0.0.1", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0,
                             procs=[rec("hub", "node1"), rec("agent", "node1"), rec("agent", "node2"), *runners])
        op = scale.Operator(doc["name"], state, log=lambda *_: None, register_timeout=2.0)
        op.registered = {f"{r.role}-{r.node}" for r in runners}
        op.launcher = Launcher(op, registers)
        op.status = lambda: SimpleNamespace(endpoints=[endpoint("agent-node1", "node1", "agent"),
                                                       endpoint("agent-node2", "node2", "agent")]
                                            + [endpoint(n, "node2") for n in sorted(op.registered)])
        op.note = lambda *a, **k: None
        made.append(op)
        return op

    yield make
    for op in made:
        op.close()


def test_a_second_runner_on_a_node_gets_its_own_name_and_log(operator):
    op = operator([rec("rollout", "node2")])
    out = op.scale("rollout+1")
    assert out.started == ["rollout-node2-1"]
    (start,) = op.launcher.starts
    assert start["name"] == "rollout-node2-1" and start["file_name"] == "rollout-node2-1"
    names = [scale.endpoint_name(r) for r in op.state.procs if r.role == "rollout"]
    assert names == ["rollout-node2", "rollout-node2-1"]
    assert len({r.log for r in op.state.procs if r.role == "rollout"}) == 2


def test_a_node_with_room_for_two_takes_two_in_one_call(operator):
    op = operator([])
    out = op.scale("rollout=2")
    assert out.started == ["rollout-node2", "rollout-node2-1"]
    op.scale("rollout-1")
    assert [scale.endpoint_name(r) for r in op.state.procs if r.role == "rollout"] == ["rollout-node2"]
    assert op.scale("rollout+1").started == ["rollout-node2-1"]  # the freed index is reused


def test_a_start_that_never_registers_its_own_name_fails_and_is_rolled_back(operator):
    op = operator([rec("rollout", "node2")], registers=False)
    with pytest.raises(scale.ScaleError, match="rollout-node2-1 exited before registering"):
        op.scale("rollout+1")
    assert op.launcher.stopped == [101]
    assert [r.pid for r in op.state.procs if r.role == "rollout"] == [1]


def test_a_name_a_live_endpoint_holds_is_skipped(operator):
    op = operator([])
    op.registered.add("rollout-node2")  # started by hand, not by scale: not recorded
    assert op.scale("rollout+1").started == ["rollout-node2-1"]


def test_ssh_start_writes_a_log_and_pid_file_per_runner(tmp_path):
    from tensorhub_cli.launch.ssh import SshLauncher
    from tensorhub_cli.spec import load

    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    doc["launcher"] = "ssh"
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    spec = load(tmp_path / "s.yaml")
    sent = []
    stat = "4242 (python) S " + " ".join(["0"] * 18) + " 777 0 0"

    class Session:
        def run(self, command, timeout=None, stdin=None):
            sent.append(command)
            return 0, f"4242\n{stat}\n", ""

    launcher = SshLauncher(spec, tmp_path)
    launcher.session = lambda node: Session()
    launcher.node_dir = lambda node: "/d"
    node = spec.node("node2")
    first = launcher.start(node, "rollout", "runners.rollout", [])
    second = launcher.start(node, "rollout", "runners.rollout", [], name="rollout-node2-1")
    assert "> rollout.log" in sent[0] and "> rollout.pid" in sent[0] and first.log == "/d/rollout.log"
    assert "> rollout-node2-1.log" in sent[1] and "> rollout-node2-1.pid" in sent[1]
    assert second.log == "/d/rollout-node2-1.log" and second.starttime == 777


def test_restart_starts_a_dead_runner_again_under_its_own_name(operator):
    dead = rec("rollout", "node2", pid=7)
    dead.name = "rollout-node2-1"
    op = operator([rec("rollout", "node2"), dead])
    op.registered.discard("rollout-node2-1")  # it died and expired
    ((old, new),) = op.restart([dead])
    assert old is dead and new.name == "rollout-node2-1" and new.pid == 101
    assert op.launcher.starts == [{"node": "node2", "name": "rollout-node2-1", "file_name": "rollout-node2-1"}]
    assert [r.pid for r in op.state.procs if r.role == "rollout"] == [1, 101]


def test_a_failed_restart_puts_the_old_record_back(operator):
    dead = rec("rollout", "node2", pid=7)
    op = operator([dead], registers=False)
    op.registered.discard("rollout-node2")
    with pytest.raises(scale.ScaleError, match="exited before registering"):
        op.restart([dead])
    assert op.launcher.stopped == [101] and [r.pid for r in op.state.procs if r.role == "rollout"] == [7]
