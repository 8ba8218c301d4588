"""`th up` with ``launcher: ray`` on a real Ray cluster of this machine.

The Ray cluster: a head and a worker raylet (``ray_rig.RayNode``) on two loopback
addresses, each its own Ray node; a third joins and is killed later. The CLI runs as a
Ray driver (``address: HEAD:PORT``). What is checked, in one run (starting Ray costs
seconds of CPU on a small machine):

- `th up` starts the hub and one agent per Ray node as detached, node-pinned actors;
  names and places come from Ray (a label names one node, the other is ray-<IP>);
- a version published and synced to every agent; a Ray task on the worker node
  joins with ``connect(name=...)`` alone (no address, token, node or TH_ variable) and
  reads it bit-exact, placed on its own node;
- a node that joins gets an agent and serves reads (a sync to it completes); a node
  that dies is failed over (its agent reported gone, the node dropped) while the
  version stays READY;
- `th scale` starts a runner in a node-pinned actor, `th failover` moves it and drains
  the node's agent, `th up` on the running cluster restarts that agent;
- `th logs` and `th status` go through the actors; `th down` leaves no actor of the
  cluster and no hub or agent process; the raylets are stopped by PID afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from ..conftest import REPO, free_port
from .ray_rig import RayNode, VerlWorker, probe, ray_env, stop_all, wait_for

pytestmark = pytest.mark.integration
ray = pytest.importorskip("ray")

HEAD, WORKER, JOINER = "127.0.0.61", "127.0.0.62", "127.0.0.63"


def th(home, *args, timeout=180, check=True):
    env = {**ray_env(), "TH_HOME": str(home)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tensorhub_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    done.seconds = time.monotonic() - started
    if check and done.returncode != 0:
        raise AssertionError(f"th {' '.join(args)} -> {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def agents(home, name) -> dict[str, bool]:
    status = json.loads(th(home, "status", "-c", name, "--json", check=False).stdout or "{}")
    if not status.get("status"):
        return {}
    return {e["node"]: e["alive"] for e in status["status"]["endpoints"] if e["kind"] == "agent"}


def our_processes(name: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if ("tensorhub_cli.agent" in cmd or "tensorhub_cli.hub" in cmd) and name in cmd:
            found.append(f"{p.info['pid']}: {cmd[:120]}")
    return found


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ray")
    port = free_port(HEAD)
    # (a raylet that dies is declared dead after 3 missed 1 s health checks, not 5 of 3 s)
    env = ray_env({"TH_AGENT_STORE": str(tmp_path / "store"), "RAY_health_check_period_ms": "1000",
                   "RAY_health_check_failure_threshold": "3"})
    # (short: Ray's unix sockets live under it, and a socket path has at most 107 bytes)
    temp_dir = Path(tempfile.mkdtemp(prefix="thray-", dir="/tmp"))
    nodes: list[RayNode] = []
    try:
        nodes.append(RayNode(HEAD, tmp_path / "ray-head.log", head_port=port, env=env, temp_dir=temp_dir))
        print(f"ray start --head: {nodes[0].wait_started():.1f}s")
        nodes.append(RayNode(WORKER, tmp_path / "ray-worker.log", address=f"{HEAD}:{port}", env=env,
                             labels={"tensorhub.io/node": "w1", "tensorhub.io/rack": "r2"}))
        ray.init(address=f"{HEAD}:{port}", namespace="th-test", log_to_driver=False, logging_level="ERROR")
        print(f"ray start --address: {nodes[1].wait_started():.1f}s")
        wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == 2, 120, "two live Ray nodes")
        yield nodes, f"{HEAD}:{port}", env
    finally:
        if ray.is_initialized():
            ray.shutdown()
        left = stop_all(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes left after SIGKILL: {left}"


def spec_file(tmp_path, address) -> tuple[str, object]:
    doc = yaml.safe_load((REPO / "specs" / "ray.yaml").read_text())
    # a stand-in rollout runner: registers under its name, stays until SIGTERM
    doc["roles"]["rollout"]["runner"] = {"command": "tests.integration.flaky",
                                         "args": ["--counter", str(tmp_path / "starts")]}
    doc["name"] = name = f"ray{free_port() % 10000}"
    doc["ray"] = {"address": address, "follow_s": 0.5, "namespace": "th-test"}
    doc["engine"] = "tcp"
    doc["hub"].update(port=free_port(HEAD), heartbeat_s=0.5, expiry_s=2.0)
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return name, path


def test_th_up_on_a_ray_cluster_follows_its_nodes(tmp_path, ray_cluster):
    nodes, address, env = ray_cluster
    home = tmp_path / "th_home"
    name, spec = spec_file(tmp_path, address)
    ckpt = tmp_path / "policy.safetensors"
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.randn(512, 1024), "b": torch.arange(1000, dtype=torch.int32)}, str(ckpt))
    try:
        up = th(home, "up", str(spec))
        print(f"th up: {up.seconds:.1f}s\n{up.stdout}")
        assert agents(home, name) == {"ray-127-0-0-61": True, "w1": True}
        running = yaml.safe_load((home / name / "spec.yaml").read_text())
        racks = {n["name"]: r["name"] for dc in running["topology"]["datacenters"] for r in dc["racks"]
                 for n in r["nodes"]}
        assert racks == {"ray-127-0-0-61": "rack0", "w1": "r2"} and running["hub"]["node"] == "ray-127-0-0-61"
        named = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "th-test"}
        assert named == {f"{name}.hub-ray-127-0-0-61", f"{name}.agent-ray-127-0-0-61", f"{name}.agent-w1",
                         f"{name}.follow"}

        th(home, "publish", "policy", "--from", str(ckpt))
        th(home, "sync", "policy", "--role", "agent")
        worker_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == WORKER)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(probe).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            worker_id, soft=False))
        got = ray.get(task.remote("policy", str(ckpt)), timeout=120)
        assert got["equal"] and got["version"] == 1 and (got["node"], got["rack"]) == ("w1", "r2"), got
        assert "agent" in th(home, "logs", "w1").stdout

        # A node joins: it gets an agent, and a sync to it completes (it serves reads).
        joined_at = time.monotonic()
        nodes.append(RayNode(JOINER, tmp_path / "ray-joiner.log", address=address, env=env))
        nodes[-1].wait_started()
        registered_at = time.monotonic()
        wait_for(lambda: agents(home, name).get("ray-127-0-0-63"), 60, "the joined node's agent", every=0.5)
        th(home, "sync", "policy", "--node", "ray-127-0-0-63")
        print(f"joined node serving reads {time.monotonic() - registered_at:.1f}s after it joined "
              f"({time.monotonic() - joined_at:.1f}s after its `ray start`)")

        # It dies: failed over (its agent gone), dropped from the running spec; v1 stays READY.
        nodes[-1].kill()
        nodes.pop()
        wait_for(lambda: "ray-127-0-0-63" not in (home / name / "spec.yaml").read_text(), 90,
                 "the dead node dropped from the running spec", every=0.5)
        state = json.loads((home / name / "state.json").read_text())
        assert {(p["role"], p["node"]) for p in state["procs"]} == {
            ("hub", "ray-127-0-0-61"), ("agent", "ray-127-0-0-61"), ("agent", "w1")}
        versions = json.loads(th(home, "versions", "policy", "--json").stdout)
        assert [v["state"] for v in versions] == ["READY"], versions
        follower = ray.get_actor(f"{name}.follow", namespace="th-test")
        lines = ray.get(follower.events.remote(), timeout=30)
        assert any("ray-127-0-0-63 left the Ray cluster: failing it over" in ln for ln in lines), lines

        # th scale and th failover through the actors: a runner (under its supervisor, in
        # a node-pinned actor) starts on the head; failing the head over moves it to w1
        # and drains the head's agent; th up on the running cluster brings that back.
        def placed():
            procs = json.loads((home / name / "state.json").read_text())["procs"]
            return sorted((p["role"], p["node"]) for p in procs if p["role"] in ("rollout", "agent"))

        th(home, "scale", "rollout=1", "-c", name)
        assert placed() == [("agent", "ray-127-0-0-61"), ("agent", "w1"), ("rollout", "ray-127-0-0-61")]
        th(home, "failover", "ray-127-0-0-61", "-c", name)
        assert placed() == [("agent", "w1"), ("rollout", "w1")]
        again = th(home, "up", str(spec))
        assert "restarted agent@ray-127-0-0-61" in again.stdout, again.stdout
        assert agents(home, name) == {"ray-127-0-0-61": True, "w1": True}
        th(home, "scale", "rollout=0", "-c", name)
        assert placed() == [("agent", "ray-127-0-0-61"), ("agent", "w1")]
    finally:
        down = th(home, "down", "-c", name, check=False)
        print(down.stdout, down.stderr)
    assert down.returncode == 0, down.stderr
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(name + ".")]
    assert left == [], left
    wait_for(lambda: not our_processes(name), 20, "no hub or agent process left")


def test_a_verl_job_on_ray_syncs_every_step_through_tensorhub(tmp_path, ray_cluster):
    """Trainer and rollouts as Ray actors, the engine configured with ``model`` only
    (the joiner also names the cluster; no node either way): steps 0..3 bit-exact on
    every rollout; a rollout joining at step 2 on the worker node reads it from the
    rollout there, none of it from the trainer."""
    pytest.importorskip("verl")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes, address, env = ray_cluster
    home = tmp_path / "th_home"
    name, spec = spec_file(tmp_path, address)
    ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def on(ip, role, who, cluster=None):
        pin = NodeAffinitySchedulingStrategy(ids[ip], soft=False)
        return ray.remote(VerlWorker).options(num_cpus=0, scheduling_strategy=pin).remote(role, who, cluster)

    th(home, "up", str(spec))
    actors = []
    try:
        trainer = on(HEAD, "trainer", "verl-trainer")
        rollouts = [on(WORKER, "rollout", "verl-rollout-w1"), on(HEAD, "rollout", "verl-rollout-head")]
        actors += [trainer, *rollouts]
        for step in range(4):
            if step == 2:  # joins mid-run, next to the worker node's rollout
                joiner = on(WORKER, "rollout", "verl-joiner-w1", cluster=name)  # (names it: same place)
                actors.append(joiner)
            metrics = ray.get(trainer.send.remote(step, 100 + step), timeout=120)
            assert metrics["checkpoint_engine/version"] == step + 1
            got = ray.get([r.receive.remote(step, 100 + step) for r in rollouts], timeout=120)
            assert all(g["equal"] and g["version"] == step + 1 for g in got), got
            assert [g["node"] for g in got] == ["w1", "ray-127-0-0-61"]
            if step >= 2:
                j = ray.get(joiner.receive.remote(step, 100 + step), timeout=120)
                assert j["equal"] and j["version"] == step + 1 and j["node"] == "w1", j
                if step == 2:  # its first: from the rollout on its own node, not the trainer
                    assert j["bytes"] > 0 and j["from_publishers"] == 0, j
    finally:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception:
                pass
            ray.kill(a)
        down = th(home, "down", "-c", name, check=False)
    assert down.returncode == 0, down.stderr
    wait_for(lambda: not our_processes(name), 20, "no hub or agent process left")
