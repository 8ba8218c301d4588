"""A real Ray cluster on this machine for tests: raylets on distinct loopback addresses.

``RayNode`` runs ``ray start --block`` (head or worker) in a session of its own, with the
environment the test gives (``PYTHONPATH`` = this tree, so Ray workers import our
``tensorhub_cli``), every port that has a fixed default set to a free one (several
raylets share the machine), 1 CPU, a small object store and no dashboard. ``stop``
ends it by PID: it collects the process tree of its ``ray start`` (GCS, raylet, agents,
workers, and the workers' children) first, sends SIGTERM to each, then SIGKILL to what
is left after ``timeout``: nothing of it survives, and nothing else is signalled (no
``ray stop``, which stops every Ray on the machine).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ..conftest import REPO, free_port

RAY = str(Path(sys.executable).with_name("ray"))
# SIGTERM to SIGKILL. Waiting longer buys nothing: 20 s after SIGTERM both `ray start
# --block` processes, the GCS and the autoscaler monitor still ran, the raylets and
# workers they had not reaped lay as zombies, and SIGKILL ended them all the same.
GRACE_S = 5.0


def ray_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TH_", "RAY_"))}
    # (a raylet on a busy 2-core machine may take longer than Ray's default 30 s to register)
    env.update(PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="120",
               **(extra or {}))
    return env


class RayNode:
    def __init__(self, ip: str, log: Path, *, head_port: int | None = None, address: str | None = None,
                 labels: dict | None = None, env: dict | None = None, temp_dir: Path | None = None,
                 prefix: list[str] | None = None):
        # (inside a namespace node (``prefix``) every port of its own network is free)
        port = (lambda: free_port(ip)) if prefix is None else free_port
        argv = [RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", "1", "--disable-usage-stats",
                "--object-store-memory", str(80 << 20), "--dashboard-agent-listen-port", str(port()),
                "--metrics-export-port", str(port())]
        if head_port is not None:
            argv += ["--head", "--port", str(head_port), "--include-dashboard=false",
                     "--ray-client-server-port", str(port())]
            if temp_dir is not None:
                argv += ["--temp-dir", str(temp_dir)]
        else:
            argv += ["--address", address]
        if labels:
            argv += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        self.ip = ip
        self.address = f"{ip}:{head_port}" if head_port is not None else address
        self.log = log
        self.out = open(log, "ab")
        self.proc = subprocess.Popen([*(prefix or []), *argv], stdin=subprocess.DEVNULL, stdout=self.out,
                                     stderr=subprocess.STDOUT, env=env or ray_env(), start_new_session=True)

    def wait_started(self, timeout: float = 120.0) -> float:
        """Until ``ray start`` says the node runs (its raylet registered); seconds taken."""
        began = time.monotonic()

        def started() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"ray start on {self.ip} exited {self.proc.returncode}; see {self.log}")
            return "Ray runtime started" in self.log.read_text(errors="replace")

        wait_for(started, timeout, f"the Ray node on {self.ip} ({self.log})")
        return time.monotonic() - began

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float | None = None) -> list[int]:
        """Stop it and everything it started; the PIDs still alive after SIGKILL (none)."""
        return stop_all([self], GRACE_S if timeout is None else timeout)

    def kill(self) -> list[int]:
        """The node dies at once (SIGKILL to its whole tree): Ray sees it leave."""
        procs = self.tree()
        _each(procs, psutil.Process.kill)
        return self._reaped(procs, 10)

    def _reaped(self, procs: list[psutil.Process], timeout: float) -> list[int]:
        """Wait for ``procs`` and our own child; the PIDs still alive."""
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.out.close()
        return [p.pid for p in alive]


def stop_all(nodes: list[RayNode], timeout: float | None = None) -> list[int]:
    """``stop`` every node at once: one SIGTERM round and one wait (``GRACE_S``), so
    their shutdowns overlap (node after node, each waited out its slowest process: a
    two-node teardown took 44 s); the PIDs still alive after SIGKILL (none)."""
    timeout = GRACE_S if timeout is None else timeout
    trees = [node.tree() for node in nodes]
    _each([q for tree in trees for q in tree], lambda q: q.send_signal(signal.SIGTERM))
    _, alive = psutil.wait_procs([q for tree in trees for q in tree], timeout=timeout)
    _each(alive, psutil.Process.kill)
    return [pid for node, tree in zip(nodes, trees) for pid in node._reaped([q for q in alive if q in tree], 5)]


def wait_for(predicate, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def probe(model: str, want_path: str) -> dict:
    """A Ray task's body: join the TensorHub cluster with no address, token or node
    given (and no ``TH_*`` variable set), fetch ``latest`` of ``model`` and compare it
    with the checkpoint at ``want_path``."""
    import torch
    from safetensors.torch import load_file

    from tensorhub_cli import connect

    # (TH_AGENT_STORE only keeps the test's agents' copies in its own directory)
    assert not [k for k in os.environ if k.startswith("TH_") and k != "TH_AGENT_STORE"], "a TH_ variable reached Ray"
    want = load_file(want_path)
    into = {k: torch.empty_like(v) for k, v in want.items()}
    with connect(name=f"probe-{os.getpid()}", role="probe") as ep:
        version = ep.fetch(model, "latest", into=into, timeout=60)
        info = ep.info
        return {"version": version, "node": info.node, "rack": info.rack, "dc": info.dc,
                "equal": all(torch.equal(into[k], want[k]) for k in want), "bytes": ep.last_fetch.get("bytes")}


class VerlWorker:
    """A verl trainer or rollout worker as a Ray actor: verl's ``CheckpointEngineRegistry``
    builds the "tensorhub" engine with only ``model`` (and a name) in its engine kwargs,
    as ``examples/verl_tensorhub.yaml`` configures it; weights come from a seed
    (``verl_driver.make``), so both sides rebuild the exact bytes."""

    def __init__(self, role: str, name: str, cluster: str | None = None):
        from verl.checkpoint_engine.base import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        import_external_libs("tensorhub_cli.adapters.verl")  # as custom_backend_module is imported
        verl_kwargs = dict(is_master=True, bucket_size=1 << 20) if role == "trainer" else dict(bucket_size=1 << 20)
        where = {"cluster": cluster} if cluster else {}  # named or not, Ray places us
        self.engine = CheckpointEngineRegistry.new("tensorhub", **verl_kwargs, model="policy", name=name,
                                                   receive_timeout_s=60.0, **where)

    def send(self, step: int, seed: int) -> dict:
        import asyncio

        from .verl_driver import stream

        return asyncio.run(self.engine.send_weights(stream(seed, None), global_steps=step))

    def receive(self, step: int, seed: int) -> dict:
        import asyncio

        import torch

        from .verl_driver import collect, make

        got, _ = asyncio.run(collect(self.engine, step))
        want = make(seed)
        last = self.engine.last_receive
        return {"version": last["version"], "bytes": last["bytes"], "from_publishers": last["from_publishers"],
                "node": self.engine._ep[0].info.node,
                "equal": got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)}

    def close(self) -> None:
        self.engine.close()


def _each(procs: list[psutil.Process], act) -> None:
    """``act`` on every process still there."""
    for p in procs:
        try:
            act(p)
        except psutil.NoSuchProcess:
            pass
