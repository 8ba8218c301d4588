"""`th up` on a running cluster reconciles: only with the spec the cluster runs (else
the changed fields are named and nothing changes), restarting only what died; the
hub's pre-flight bind check is not blocked by a killed hub's TIME_WAIT sockets."""

from __future__ import annotations

import shutil
import socket

import pytest
import yaml

from tensorhub_cli.launch import cluster
from tensorhub_cli.launch.local import LocalLauncher
from tensorhub_cli.launch.procs import ProcRecord
from tensorhub_cli.launch.state import ClusterState, cluster_dir, read_state, write_state, write_token
from tensorhub_cli.spec import load
from tensorhub_cli.spec.diff import changed_fields

from ..conftest import REPO, free_port


def time_wait_port(host: str = "127.0.0.1") -> int:
    """A port with a connection in TIME_WAIT on its listening side (the side that
    closed first), as a hub killed with connected endpoints leaves."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection((host, port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its (host, port) end goes to TIME_WAIT
        client.recv(1)
        client.close()
    return port


def test_preflight_binds_a_port_a_killed_hub_left_in_time_wait(tmp_path):
    port = time_wait_port()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what blocked the restart
    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"][0]["address"] = "127.0.0.1"
    doc["hub"]["port"], doc["hub"]["metrics_port"] = port, None
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    assert LocalLauncher(load(tmp_path / "s.yaml"), tmp_path).preflight() == []
    with socket.socket() as listener:  # a live listener still blocks it
        listener.bind(("127.0.0.1", free_port()))
        listener.listen()
        doc["hub"]["port"] = listener.getsockname()[1]
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
        assert "hub.port: cannot bind" in LocalLauncher(load(tmp_path / "s.yaml"), tmp_path).preflight()[0]


def test_changed_fields_name_each_difference_by_path(tmp_path):
    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(doc))
    doc["hub"]["port"] = 7800
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"][1]["address"] = "127.0.0.99"
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"].append({"name": "node4", "address": "127.0.0.14"})
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(doc))
    a, b = load(tmp_path / "a.yaml"), load(tmp_path / "b.yaml")
    assert changed_fields(a, a) == []
    assert changed_fields(a, b) == ["hub.port", "topology.datacenters[dc1].racks[rack1].nodes[node2].address",
                                    "topology.datacenters[dc1].racks[rack1].nodes[node4] (added)"]


class Launcher:
    """Nothing runs but what ``alive`` names; every start is recorded."""

    parallel = 1

    def __init__(self, alive: set[int]):
        self.live, self.started = alive, []

    def alive(self, rec) -> bool:
        return rec.pid in self.live

    def preflight(self) -> list[str]:
        return []

    def token_path(self, node, token) -> str:
        return "/tmp/token"

    def start(self, node, role, module, args, name=None) -> ProcRecord:
        self.started.append((role, node.name))
        pid = 1000 + len(self.started)
        self.live.add(pid)
        return ProcRecord(role=role, node=node.name, pid=pid, starttime=1, marker=module, log="")

    def close(self) -> None:
        pass


@pytest.fixture
def running(th_home, tmp_path, monkeypatch):
    """A recorded cluster of specs/local.yaml (hub pid 1, agents 2-4), its spec file."""
    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(doc))
    cluster_dir(doc["name"]).mkdir(parents=True)
    shutil.copyfile(path, cluster_dir(doc["name"]) / "spec.yaml")
    write_token(doc["name"], None)
    procs = [ProcRecord(role="hub", node="node1", pid=1, starttime=1, marker="m", log="")] + [
        ProcRecord(role="agent", node=f"node{i}", pid=i + 1, starttime=1, marker="m", log="") for i in (1, 2, 3)]
    write_state(ClusterState(cluster=doc["name"], launcher="local", hub_address="tcp://127.0.0.11:7700",
                             hub_node_address="127.0.0.11", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0,
                             procs=procs))

    def with_launcher(alive: set[int]) -> Launcher:
        fake = Launcher(alive)
        monkeypatch.setattr(cluster, "launcher_for", lambda *a, **k: fake)
        monkeypatch.setattr(cluster, "wait_registered", lambda *a, **k: None)
        monkeypatch.setattr(cluster, "wait_expired", lambda *a, **k: None)
        return fake

    return doc, path, with_launcher


def test_a_changed_spec_is_refused_naming_the_fields_and_nothing_changes(running):
    doc, path, with_launcher = running
    fake = with_launcher({2, 3})  # the hub and node3's agent died
    doc["hub"]["heartbeat_s"] = 1.0
    path.write_text(yaml.safe_dump(doc))
    before = read_state(doc["name"])
    with pytest.raises(cluster.SpecChanged, match=r"changed hub\.heartbeat_s; nothing changed"):
        cluster.up(load(path), path, log=lambda *_: None)
    assert fake.started == [] and read_state(doc["name"]) == before


def test_only_what_died_is_restarted_and_each_is_named(running):
    doc, path, with_launcher = running
    fake = with_launcher({2, 3})
    said = []
    out = cluster.up(load(path), path, log=said.append)
    assert fake.started == [("hub", "node1"), ("agent", "node3")]
    assert out.restarted == ["hub@node1 (pid 1001)", "agent@node3 (pid 1002)"]
    assert out.left == ["agent@node1 (pid 2)", "agent@node2 (pid 3)"]
    assert [r.pid for r in read_state(doc["name"]).procs] == [1001, 2, 3, 1002]  # the hub stays first
    assert any("restarted hub@node1 (pid 1001; pid 1 had died)" in line for line in said)
    with pytest.raises(cluster.AlreadyRunning):  # now nothing is dead: nothing to do
        cluster.up(load(path), path, log=lambda *_: None)
