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


def _wait(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_up_on_a_running_cluster_restarts_only_what_died(cluster, th_home, local_spec, tmp_path):
    """kill -9 the hub: `th up` starts a new one (TIME_WAIT does not block its port),
    leaves the agents (same PIDs), and the version an agent held is READY again (it
    re-registered with its holdings). Kill an agent: `th up` restarts only it. A
    changed spec is refused by field, changing nothing."""
    import torch
    from safetensors.torch import save_file

    name, procs = cluster
    ckpt = tmp_path / "ckpt.safetensors"
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(ckpt))
    th("publish", "policy", "--from", str(ckpt), "--node", "node2", "-c", name, check=True)
    hub = next(r for r in procs if r.role == "hub")
    os.kill(hub.pid, signal.SIGKILL)
    _wait("the hub to die", lambda: not is_ours(hub))

    again = th("up", str(local_spec), check=True)
    assert "restarted hub@node1 (pid" in again.stdout and "left      agent@node1 (pid" in again.stdout, again.stdout
    now = recorded(th_home, name)
    new_hub = next(r for r in now if r.role == "hub")
    assert new_hub.pid != hub.pid and is_ours(new_hub)
    assert [(r.role, r.node, r.pid) for r in now if r.role == "agent"] == [
        (r.role, r.node, r.pid) for r in procs if r.role == "agent"]  # the agents kept their PIDs

    def ready():
        listed = json.loads(th("versions", "policy", "-c", name, "--json").stdout or "[]")
        return listed and listed[0]["state"] == "READY" and any(
            h["name"] == "agent-node2" and h["complete"] for h in listed[0]["holders"])
    _wait("policy@1 READY again from agent-node2's retained copy", ready)

    victim = next(r for r in now if r.role == "agent" and r.node == "node3")
    os.kill(victim.pid, signal.SIGKILL)
    _wait("node3's agent to die", lambda: not is_ours(victim))
    again = th("up", str(local_spec), check=True)
    assert "restarted agent@node3 (pid" in again.stdout and "left      hub@node1 (pid" in again.stdout, again.stdout
    assert "restarted hub" not in again.stdout
    after = recorded(th_home, name)
    changed = [(a.role, a.node) for a, b in zip(now, after) if a.pid != b.pid]
    assert changed == [("agent", "node3")] and all(is_ours(r) for r in after)
    assert agents_alive(status_json(name)) == {"node1": True, "node2": True, "node3": True}

    doc = yaml.safe_load(local_spec.read_text())
    doc["hub"]["expiry_s"] = 2.0
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(doc, sort_keys=False))
    refused = th("up", str(other))
    assert refused.returncode == 2 and "changed hub.expiry_s" in refused.stderr, refused.stderr
    assert recorded(th_home, name) == after
    procs[:] = after  # the fixture's clean-up kills what runs now


def test_scale_starts_two_runners_of_a_role_on_a_node_with_two_gpus(th_home, local_spec):
    """Both register under their own names (no `conflict`, no runner taken for
    another), each with its own log; scaling down stops them by name."""
    doc = yaml.safe_load(local_spec.read_text())
    name = doc["name"]
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"][1]["gpus"] = 2
    doc["roles"]["rollout"]["select"] = {"nodes": ["node2"]}
    doc["roles"]["rollout"]["runner"] = {"command": "runners.rollout", "args": [
        "--hidden", "64", "--layers", "2", "--vocab", "512", "--arch", "torch", "--wait-s", "120"]}
    local_spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    th("up", str(local_spec), check=True)
    try:
        up = json.loads(th("scale", "rollout=2", "-c", name, "--json", timeout=200, check=True).stdout)
        assert up["started"] == ["rollout-node2", "rollout-node2-1"]
        doc = status_json(name)
        alive = {e["name"] for e in doc["status"]["endpoints"] if e["alive"]}
        assert {"rollout-node2", "rollout-node2-1"} <= alive
        runners = [p for p in doc["processes"] if p["role"] == "rollout"]
        assert [p["name"] for p in runners] == ["rollout-node2", "rollout-node2-1"]
        assert all(p["running"] for p in runners)
        assert len({p["log"] for p in runners}) == 2

        # A runner that died is restarted by `th up`, under its name, on its node; the rest is left.
        second = next(r for r in recorded(th_home, name) if r.name == "rollout-node2-1")
        os.kill(second.pid, signal.SIGKILL)
        _wait("the runner to die", lambda: not is_ours(second))
        again = th("up", str(local_spec), timeout=200, check=True)
        assert "restarted rollout-node2-1@node2 (pid" in again.stdout, again.stdout
        assert "left      rollout-node2@node2" in again.stdout
        assert "restarted hub" not in again.stdout and "restarted agent" not in again.stdout, again.stdout
        back = next(r for r in recorded(th_home, name) if r.name == "rollout-node2-1")
        assert back.pid != second.pid and is_ours(back) and back.log == second.log
        assert "rollout-node2-1" in {e["name"] for e in status_json(name)["status"]["endpoints"] if e["alive"]}
        down = json.loads(th("scale", "rollout=0", "-c", name, "--json", timeout=200, check=True).stdout)
        assert down["stopped"] == ["rollout-node2-1", "rollout-node2"]
    finally:
        th("down", "-c", name, timeout=200)


def _watch_snapshots(name: str, want: int = 2, timeout: float = 30.0) -> str:
    """`th status --watch` with stdout a pipe (not a terminal): it must print whole
    snapshots as it goes; stopped with SIGINT, as Ctrl-C would, after ``want``."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorhub_cli", "status", "--watch", "--interval", "0.2",
                             "-c", name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "220"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        _wait(f"{want} --watch snapshots on a pipe",
              lambda: sum(ln.startswith("--- th status --watch") for ln in list(lines)) >= want, timeout)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    return "".join(lines)


def test_failover_of_a_dead_agent_says_what_was_lost_and_up_brings_the_node_back(th_home, local_spec, tmp_path):
    """The operator path of issue 22: sync with no runner points to `th scale`; `--role
    agent` syncs the agents; `kill -9` an agent, `th failover` says it was already gone
    and which copies the hub listed for it; `th status` keeps the node (spec order,
    out of service) and shows the hub counters; `--watch` on a pipe prints snapshots
    listing agents; `th up` brings the node back; a second `th down` is exit 0."""
    import torch
    from safetensors.torch import save_file

    doc = yaml.safe_load(local_spec.read_text())
    doc["hub"]["expiry_s"] = 5.0  # the hub still lists the killed agent (and its copy) when failover asks
    local_spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    name = doc["name"]
    th("up", str(local_spec), check=True)
    procs = recorded(th_home, name)
    try:
        ckpt = tmp_path / "ckpt.safetensors"
        save_file({"w": torch.arange(100_000, dtype=torch.float32)}, str(ckpt))
        th("publish", "policy", "--from", str(ckpt), "--node", "node3", "-c", name, check=True)
        none = th("sync", "policy", "--role", "rollout", "-c", name)
        assert none.returncode == 2, none.stderr
        assert none.stderr.splitlines() == ["th sync: no live endpoint has role 'rollout': start some with "
                                            "`th scale rollout=N`, or sync `--role agent` (every node's agent, "
                                            "into host memory)"], none.stderr
        synced = th("sync", "policy", "--role", "agent", "-c", name, "--json", check=True)
        assert sorted(json.loads(synced.stdout)["targets"]) == ["agent-node1", "agent-node2", "agent-node3"]

        # node1 goes: its agent was started first, so start order and spec order differ once it is back.
        victim = next(r for r in procs if r.role == "agent" and r.node == "node1")
        os.kill(victim.pid, signal.SIGKILL)
        _wait("node1's agent to die", lambda: not is_ours(victim))
        failed = th("failover", "node1", "-c", name, check=True)
        assert "already gone: agent-node1" in failed.stdout and "lost: policy@1" in failed.stdout, failed.stdout
        assert "drained: -" in failed.stdout and "th up SPEC" in failed.stderr, failed.stderr

        table = th("status", "-c", name).stdout
        row = next(ln for ln in table.splitlines() if "node1" in ln and "rack1" in ln)
        assert "out of service" in row, table
        assert status_json(name)["out_of_service"] == ["node1"]
        assert "hub counters" in table and "publishes" in table and "bytes_planned" in table, table

        snapshots = _watch_snapshots(name)
        endpoints_table = snapshots.split("endpoints")[1].split("versions")[0]
        assert any(ln.startswith("agent-node2 ") for ln in endpoints_table.splitlines()), snapshots
        assert "policy@1" in endpoints_table, snapshots

        back = th("up", str(local_spec), check=True)
        assert "restarted agent@node1 (pid" in back.stdout, back.stdout
        after = recorded(th_home, name)
        assert [r.node for r in after if r.role == "agent"][-1] == "node1"  # recorded last ...
        table = th("status", "-c", name).stdout
        rows = [ln for ln in table.splitlines() if "rack1" in ln]
        assert [r.split()[0] for r in rows] == ["node1", "node2", "node3"], table  # ... shown first
        assert "out of service" not in table
        doc = status_json(name)
        assert agents_alive(doc) == {"node1": True, "node2": True, "node3": True} and doc["out_of_service"] == []
        procs = after
    finally:
        th("down", "-c", name)
        for rec in procs:
            if is_ours(rec):
                os.kill(rec.pid, signal.SIGKILL)
    again = th("down", "-c", name)
    assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stdout + again.stderr
