"""Bring a cluster up and down, whatever the launcher.

Protocol of ``up``: validate → refuse if already running (changing nothing) → preflight
→ write token and spec copy → start the hub → start one agent per node → wait until
every agent has registered. Each start is recorded in ``state.json`` before the next
begins. Any failure tears down exactly what was started and raises ``UpError`` with the
reason (missing nodes with their log tails). ``down`` stops the recorded processes
that are still ours, agents first so they can deregister, then the hub.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable
from ..spec import ClusterSpec, resolve_path
from .local import LocalLauncher
from .procs import log_tail
from .state import ClusterState, clear_state, cluster_dir, read_state, read_token, write_state, write_token


class UpError(Exception):
    pass


class AlreadyRunning(Exception):
    pass


def launcher_for(kind: str, spec: ClusterSpec | None, state_dir: Path):
    """``spec`` may be None when only stopping recorded processes."""
    if kind == "local":
        return LocalLauncher(spec, state_dir)
    raise UpError(f"launcher {kind!r} is not available yet (it lands with the testbed issue)")


def running_procs(state: ClusterState, launcher) -> list[str]:
    return [f"{r.role}@{r.node} (pid {r.pid})" for r in state.procs if launcher.alive(r)]


def _token(spec: ClusterSpec, spec_path: Path) -> str | None:
    if spec.auth.token:
        return spec.auth.token
    if spec.auth.token_file:
        return resolve_path(spec.auth.token_file, spec_path.resolve().parent).read_text().strip()
    return None


def up(spec: ClusterSpec, spec_path: Path, timeout: float = 30.0, log=print) -> ClusterState:
    d = cluster_dir(spec.name)
    launcher = launcher_for(spec.launcher, spec, d)
    old = read_state(spec.name)
    if old is not None:
        alive = running_procs(old, launcher)
        if alive:
            raise AlreadyRunning(f"cluster {spec.name!r} is already running: {', '.join(alive)}")
        log(f"cluster {spec.name!r}: clearing stale state of a cluster that is no longer running")
        clear_state(spec.name)
    problems = launcher.preflight()
    if problems:
        raise UpError("\n".join(problems))

    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spec_path, d / "spec.yaml")
    token_file = write_token(spec.name, _token(spec, spec_path))
    hub_node = spec.node(spec.hub.node)
    state = ClusterState(
        cluster=spec.name,
        launcher=spec.launcher,
        hub_address=f"tcp://{hub_node.spec.address}:{spec.hub.port}",
        hub_node_address=hub_node.spec.address,
        metrics_port=spec.hub.metrics_port,
        heartbeat_s=spec.hub.heartbeat_s,
        expiry_s=spec.hub.expiry_s,
    )
    try:
        hub_args = ["--bind", state.hub_address, "--token-file", str(token_file), "--cluster", spec.name,
                    "--expiry-s", str(spec.hub.expiry_s)]
        if spec.hub.metrics_port:
            hub_args += ["--metrics-port", str(spec.hub.metrics_port), "--metrics-addr", hub_node.spec.address]
        for m in spec.models:
            hub_args += ["--retain", f"{m.name}={m.retain.keep_latest}:{m.retain.min_reliable_copies}"]
        state.procs.append(launcher.start(hub_node, "hub", "tensorhub_cli.hub", hub_args))
        write_state(state)
        log(f"hub     {hub_node.name:<12} {state.hub_address}")
        for node in spec.nodes():
            args = ["--hub", state.hub_address, "--token-file", str(token_file), "--node", node.name,
                    "--address", node.spec.address, "--dc", node.dc, "--rack", node.rack,
                    "--heartbeat-s", str(spec.hub.heartbeat_s), "--engine", spec.engine] + (
                        ["--spot"] if node.spec.spot else [])
            state.procs.append(launcher.start(node, "agent", "tensorhub_cli.agent", args))
            write_state(state)
            log(f"agent   {node.name:<12} {node.spec.address}")
        wait_registered(spec, state, launcher, timeout)
    except BaseException:
        down_state(state, launcher, log=lambda *_: None)
        raise
    return state


def wait_registered(spec: ClusterSpec, state: ClusterState, launcher, timeout: float) -> None:
    want = {f"agent-{n.name}": n.name for n in spec.nodes()}
    client = HubClient(state.hub_address, read_token(spec.name))
    deadline = time.monotonic() + timeout
    missing = set(want)
    try:
        while time.monotonic() < deadline:
            hub = state.procs[0]
            if not launcher.alive(hub):
                raise UpError(f"hub exited during start-up; its log ends:\n{log_tail(hub.log)}")
            try:
                status = client.call(p.Status(), timeout=1.0)
                missing = set(want) - {e.name for e in status.endpoints if e.alive}
                if not missing:
                    return
            except (HubUnreachable, HubError):
                pass
            time.sleep(0.1)
    finally:
        client.close()
    lines = [f"timed out after {timeout:.0f}s waiting for node(s) to register: "
             + ", ".join(sorted(want[m] for m in missing))]
    for rec in state.procs:
        if f"agent-{rec.node}" in missing:
            lines.append(f"--- {rec.node} ({rec.log}):\n{log_tail(rec.log)}")
    raise UpError("\n".join(lines))


def down_state(state: ClusterState, launcher, log=print) -> list[tuple[str, str, str]]:
    results = []
    for rec in sorted(state.procs, key=lambda r: r.role == "hub"):
        outcome = launcher.stop(rec)
        results.append((rec.role, rec.node, outcome))
        log(f"{rec.role:<7} {rec.node:<12} {outcome}")
    clear_state(state.cluster)
    return results


def down(name: str, log=print) -> list[tuple[str, str, str]]:
    state = read_state(name)
    if state is None:
        raise LookupError(f"cluster {name!r} is not running (no state under {cluster_dir(name)})")
    return down_state(state, launcher_for(state.launcher, None, cluster_dir(name)), log=log)
