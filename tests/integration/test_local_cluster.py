"""`th up` / `th status` / `th down` on a local cluster: real processes, real sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from tensorhub_cli.launch.procs import ProcRecord, is_ours

pytestmark = pytest.mark.integration


def th(*args, timeout=60, check=False):
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ.copy())
    if check and proc.returncode != 0:
        raise AssertionError(f"th {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def recorded(th_home, name) -> list[ProcRecord]:
    import msgspec

    from tensorhub_cli.launch.state import ClusterState

    return msgspec.json.decode((th_home / name / "state.json").read_bytes(), type=ClusterState).procs


@pytest.fixture
def cluster(th_home, local_spec):
    name = yaml.safe_load(local_spec.read_text())["name"]
    th("up", str(local_spec), check=True)
    procs = recorded(th_home, name)
    yield name, procs
    th("down", "-c", name)
    for rec in procs:  # whatever happened above, leave nothing behind
        if is_ours(rec):
            os.kill(rec.pid, signal.SIGKILL)


def status_json(name):
    proc = th("status", "-c", name, "--json", check=True)
    return json.loads(proc.stdout)


def agents_alive(doc):
    return {e["node"]: e["alive"] for e in doc["status"]["endpoints"] if e["kind"] == "agent"}


def test_up_status_down_leaves_nothing(cluster, th_home, local_spec):
    name, procs = cluster
    doc = status_json(name)
    assert doc["hub"]["reachable"]
    assert agents_alive(doc) == {"node1": True, "node2": True, "node3": True}
    assert all(p["running"] for p in doc["processes"])
    assert doc["status"]["versions"] == []

    again = th("up", str(local_spec), check=True)
    assert "already running" in again.stdout and "nothing changed" in again.stdout
    assert recorded(th_home, name) == procs  # the second up started nothing

    down = th("down", "-c", name, check=True)
    assert down.stdout.count("stopped") == len(procs)
    assert not any(is_ours(r) for r in procs)
    assert not (th_home / name / "state.json").exists()
    assert th("status", "-c", name).returncode == 2


def test_versions_lists_what_the_hub_holds(cluster):
    from tensorhub_cli.hub import protocol as p
    from tensorhub_cli.hub.client import HubClient
    from tensorhub_cli.launch.state import read_state, read_token

    name, _ = cluster
    assert json.loads(th("versions", "-c", name, "--json", check=True).stdout) == []
    address, token = read_state(name).hub_address, read_token(name)
    client = HubClient(address, token)
    stop = threading.Event()

    def beat():  # an endpoint that stops beating loses its references (its own client: one per thread)
        beater = HubClient(address, token)
        while not stop.wait(0.3):
            beater.call(p.Heartbeat(name="trainer-0"))
        beater.close()

    beater = threading.Thread(target=beat)
    try:
        client.call(p.Register(info=p.EndpointInfo(name="trainer-0", node="node1", pid=os.getpid())))
        beater.start()
        tensors = [p.TensorMeta(name="w", dtype="uint8", shape=[3000], nbytes=3000, offset=0)]
        chunks = [p.ChunkMeta(nbytes=1024, checksum=1), p.ChunkMeta(nbytes=1024, checksum=2),
                  p.ChunkMeta(nbytes=952, checksum=3)]
        client.call(p.Publish(name="trainer-0", model="policy", version=7,
                              manifest=p.Manifest(tensors=tensors, chunks=chunks, chunk_bytes=1024)))
        listed = json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout)
        assert [(v["model"], v["version"], v["state"], v["chunks"], v["nbytes"], v["replicas"]) for v in listed] == [
            ("policy", 7, "READY", 3, 3000, 1)]
        typo = th("versions", "polcy", "-c", name)
        assert typo.returncode == 2 and "'polcy' has no versions" in typo.stderr
        table = th("versions", "-c", name, check=True).stdout
        assert "policy" in table and "READY" in table
    finally:
        stop.set()
        if beater.is_alive():
            beater.join(timeout=10)
        client.close()

def test_killed_agent_shows_not_alive_within_expiry(cluster, local_spec):
    name, procs = cluster
    expiry = yaml.safe_load(local_spec.read_text())["hub"]["expiry_s"]
    victim = next(r for r in procs if r.role == "agent" and r.node == "node2")
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while True:
        alive = agents_alive(status_json(name))
        if alive.get("node2") is not True:
            break
        assert time.monotonic() - killed_at < expiry + 1.0, "node2 still alive after the heartbeat timeout"
        time.sleep(0.1)
    assert alive.get("node1") and alive.get("node3")
    table = th("status", "-c", name).stdout
    row = next(ln for ln in table.splitlines() if "node2" in ln)
    assert "no" in row and "gone" in row


def test_up_timeout_names_missing_node_and_tears_down(th_home, local_spec):
    doc = yaml.safe_load(local_spec.read_text())
    # node3's agent runs a python that exits at once, so it never registers.
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"][2]["bootstrap"] = {"python": "/bin/false"}
    local_spec.write_text(yaml.safe_dump(doc))
    proc = th("up", str(local_spec), "--timeout", "3")
    assert proc.returncode == 1
    assert "node3" in proc.stderr and "timed out" in proc.stderr
    assert "node1" not in proc.stderr.split("register:")[1].splitlines()[0]
    assert not (th_home / doc["name"] / "state.json").exists()


def test_port_in_use_is_refused_before_starting(th_home, local_spec):
    import socket

    doc = yaml.safe_load(local_spec.read_text())
    addr = doc["topology"]["datacenters"][0]["racks"][0]["nodes"][0]["address"]
    with socket.socket() as s:
        s.bind((addr, doc["hub"]["port"]))
        s.listen()
        proc = th("up", str(local_spec))
    assert proc.returncode == 1
    assert "hub.port" in proc.stderr
    assert not (th_home / doc["name"] / "state.json").exists()


def test_down_never_signals_a_reused_pid(th_home):
    # A record whose PID now belongs to another process (different start time) is not ours.
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        forged = ProcRecord(role="agent", node="n", pid=sleeper.pid, starttime=1, marker="sleep", log="")
        assert not is_ours(forged)
        from tensorhub_cli.launch.procs import stop

        assert stop(forged) == "not running"
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
