"""A real hub and a real agent process: the agent's retained copy survives its
``kill -9`` in the store (/dev/shm files) and a restarted agent serves it again,
bit for bit; a corrupted copy is dropped, a discard and a clean exit delete files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from tensorhub_cli.agent.store import agent_dir
from tensorhub_cli.endpoint import connect
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient, HubError, HubUnreachable, wait_for_hub
from tensorhub_cli.launch.procs import kill_child, stop_child

from ..conftest import free_port
from .peers import wait_until

pytestmark = pytest.mark.integration
TOKEN = "s" * 32


class Rig:
    """A hub (keep_latest 1 of model ``m``, expiry 3 s: at 1 s an endpoint
    expired mid-test twice in CI on a shared 2-core host) and agent ``agent-n1`` storing
    under ``tmp``; every process is stopped by its PID at the end."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.store = agent_dir("agent-n1", self.address, base=str(tmp / "store"))
        self.procs: list[subprocess.Popen] = []
        self.eps: list = []
        self.hub = self._spawn("hub", ["-m", "tensorhub_cli.hub", "--bind", self.address, "--token-file",
                                       str(self.token_file), "--expiry-s", "3.0", "--retain", "m=1:1"])
        wait_for_hub(self.address, TOKEN, timeout=15, alive=lambda: self.hub.poll() is None)
        self.agent = None
        self.starts = 0

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def start_agent(self) -> None:
        self.starts += 1
        self.agent = self._spawn(f"agent{self.starts}", [
            "-m", "tensorhub_cli.agent", "--hub", self.address, "--token-file", str(self.token_file), "--node", "n1",
            "--address", "127.0.0.1", "--engine", "tcp", "--heartbeat-s", "0.2", "--connect-timeout-s", "60",
            "--store", str(self.tmp / "store")])
        wait_until(lambda: self.agent.poll() is not None or any(
            e.name == "agent-n1" and e.alive and e.pid == self.agent.pid for e in self.status().endpoints),
            30, f"agent-n1 to register (log: {self.log()})", every=0.1)
        assert self.agent.poll() is None, self.log()

    def log(self) -> str:
        return (self.tmp / f"agent{self.starts}.log").read_text(errors="replace")[-3000:]

    def join(self, name: str):
        ep = connect(self.address, TOKEN, name=name, engine="tcp", heartbeat_s=0.2)
        self.eps.append(ep)
        return ep

    def call(self, op):
        client = HubClient(self.address, TOKEN)
        try:
            return client.call(op, timeout=5)
        finally:
            client.close()

    def status(self) -> p.StatusReply:
        return self.call(p.Status())

    def version(self, model: str, number: int) -> p.VersionStatus | None:
        try:
            listed = self.call(p.Versions(model=model)).versions
        except (HubError, HubUnreachable):
            return None
        return next((v for v in listed if v.version == number), None)

    def close(self) -> None:
        # pytest shows what a failed test's teardown printed: the hub's expiries are here.
        print("--- hub.log\n" + (self.tmp / "hub.log").read_text(errors="replace")[-4000:])
        if self.starts:
            print(f"--- agent{self.starts}.log\n{self.log()}")
        for ep in self.eps:
            ep.close(drain_timeout=0)
        for proc in reversed(self.procs):
            stop_child(proc)


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        r.close()


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {f"w{i}": torch.randn(300_000, generator=g) for i in range(3)}  # 1.2 MB each: chunks in place
    sd.update({f"b{i}": torch.randn(100 + i, generator=g) for i in range(4)})  # packed: one chunk spans them
    sd["step"] = torch.tensor([seed], dtype=torch.int64)
    return sd


def retained_by_the_agent(rig: Rig, version: int = 1) -> None:
    """A publisher publishes m@version and leaves: retention makes the agent copy it first."""
    rig.start_agent()
    pub = rig.join(f"pub{version}")
    pub.publish("m", version, weights(version), chunk_bytes=1 << 19)
    pub.unpublish("m", version, timeout=60)  # acknowledged once the agent's copy is complete (contract 4)
    pub.close(drain_timeout=0)
    v = rig.version("m", version)
    assert v is not None and [h.name for h in v.holders if h.complete] == ["agent-n1"], v
    wait_until(lambda: (rig.store / f"m@{version}" / "complete").exists(), 10, "the copy to be marked complete")


def kill9(rig: Rig) -> None:
    kill_child(rig.agent)
    assert rig.agent.returncode == -signal.SIGKILL
    wait_until(lambda: (v := rig.version("m", 1)) and v.state == "UNAVAILABLE", 10,
               "the dead agent to expire and m@1 to become UNAVAILABLE")


def fetch(rig: Rig, name: str, timeout: float = 30.0) -> dict:
    into = {k: torch.zeros_like(t) for k, t in weights(1).items()}
    rig.join(name).fetch("m", 1, into=into, timeout=timeout)
    return into


def test_a_kill_9ed_agents_copy_survives_and_is_served_again_bit_exact(rig):
    retained_by_the_agent(rig)
    files = sorted(f.name for f in (rig.store / "m@1").iterdir())
    kill9(rig)
    assert sorted(f.name for f in (rig.store / "m@1").iterdir()) == files == ["complete", "data", "manifest"]
    rig.start_agent()
    wait_until(lambda: (v := rig.version("m", 1)) and v.state == "READY", 10, "m@1 READY from the re-adopted copy")
    log = rig.log()
    assert "re-adopted stored copy m@1" in log and "offered re-adopted copy m@1 to the hub again: READY" in log, log
    into = fetch(rig, "reader")
    want = weights(1)
    assert all(torch.equal(into[k], want[k]) for k in want)
    # A clean exit (th down: SIGTERM) leaves no files behind.
    os.kill(rig.agent.pid, signal.SIGTERM)
    assert rig.agent.wait(timeout=30) == 0, rig.log()
    assert not rig.store.exists() and not rig.store.parent.exists(), list(rig.store.parent.rglob("*"))


def test_a_corrupted_surviving_copy_is_dropped_not_served(rig):
    retained_by_the_agent(rig)
    kill9(rig)
    data = rig.store / "m@1" / "data"
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0x01
    data.write_bytes(bytes(raw))
    rig.start_agent()
    assert "dropped stored copy m@1: checksum differs" in rig.log()
    assert not (rig.store / "m@1").exists()
    v = rig.version("m", 1)
    assert v.state == "UNAVAILABLE" and not v.holders, v
    with pytest.raises(HubError, match="m@1 is UNAVAILABLE"):
        fetch(rig, "reader", timeout=5)


def test_a_discard_deletes_the_copys_files(rig):
    retained_by_the_agent(rig, 1)
    pub = rig.join("pub2")
    pub.publish("m", 2, weights(2), chunk_bytes=1 << 19)  # keep_latest 1: the hub forgets m@1, releasing it
    wait_until(lambda: not (rig.store / "m@1").exists(), 10, f"m@1's files to go (log: {rig.log()})")
    assert rig.version("m", 1) is None and rig.agent.poll() is None
    assert "removed stored copy m@1" in rig.log()


def test_th_down_clears_the_store_a_killed_agent_left(th_home, local_spec, tmp_path, monkeypatch):
    """An agent killed -9 cannot clear its own store; `th down` does it (nobody would
    adopt those copies once the cluster is gone). A clean exit needs no help."""
    import json

    import yaml

    monkeypatch.setenv("TH_AGENT_STORE", str(tmp_path / "shm"))  # inherited by the agents `th up` starts
    name = yaml.safe_load(local_spec.read_text())["name"]

    def th(*args):
        return subprocess.run([sys.executable, "-m", "tensorhub_cli", *args], capture_output=True, text=True,
                              timeout=120)
    assert th("up", str(local_spec)).returncode == 0
    try:
        state = json.loads((th_home / name / "state.json").read_text())
        agent = next(r for r in state["procs"] if r["role"] == "agent" and r["node"] == "node2")
        left = agent_dir("agent-node2", state["hub_address"], name)
        assert str(left).startswith(str(tmp_path / "shm"))
        (left / "m@1").mkdir(parents=True)  # what a copy it held would have left
        (left / "m@1" / "data").write_bytes(b"x" * 64)
        os.kill(agent["pid"], signal.SIGKILL)
    finally:
        down = th("down", "-c", name)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not left.exists()
    assert not any((tmp_path / "shm").rglob("data"))  # the live agents' clean exits left nothing either
