"""Bring a cluster up and down, whatever the launcher.

Protocol of ``up``: validate → if a recorded process of the cluster still lives,
reconcile (below) → preflight (every node reachable and able to run us) → write token
and spec copy → start the hub → start one agent per node, through a bounded pool →
wait until every agent has registered → start the runners each role's ``count``
declares (``scale``: placed, supervised by ``agent.supervise``, registered). Each start is recorded in ``state.json`` as it
returns. Any failure tears down exactly what was started and raises ``UpError`` with
the reason (per node: ssh errors, or the log tail of an agent that died). ``down``
stops the recorded processes that are still ours, agents first so they can
deregister, then the hub.

Protocol of ``reconcile`` (``up`` on a running cluster, as ``ray up`` does): the spec
given must be the one the cluster runs (the copy in the state directory), else
``SpecChanged`` names the changed fields and nothing changes. Every recorded process
still alive is left as it is; what died is started again with the arguments ``up``
gives it: the hub first (its preflight bind check first: SO_REUSEADDR, so the
TIME_WAIT sockets of a killed hub do not block it), then missing agents, then, once
every agent is registered, the recorded runners (``scale.Operator.restart``, under
the names they had; a dead runner whose supervisor recorded that it finished, exit 0,
is forgotten instead). Soft state (contract 7) does the rest: live agents and runners
re-register with a restarted hub carrying their holdings, so retained copies stay.
Each restart is recorded as it returns; a failure stops nothing that lived and
raises ``ReconcileError`` (an ``UpError``); what it did restart stays recorded (``th down`` stops it, another
``th up`` retries the rest). Nothing died: ``AlreadyRunning``.

Launcher ``ray``: the spec given names a Ray cluster, not nodes; ``up`` first resolves
it against the live Ray nodes (``ray_nodes``) and runs that spec (``spec.yaml``; the
given one is kept as ``given.yaml``, which ``reconcile`` compares), and ends by starting
the cluster's follower (``ray_follow``: joins get agents, leaves are failed over);
``down`` stops the follower first and kills any actor of the cluster left at the end.

Every wait has a limit the caller may set: ``up(timeout=)`` for registration (and
``call_timeout`` per status request to the hub), ``down(stop_timeout=)`` per process,
``processes_alive(connect_timeout=)`` per unreachable node. ssh connections take the
spec's ``ssh.connect_timeout_s``; agents (and runners, ``scale``) get the spec's
``endpoints`` limits as flags.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable
from ..spec import ClusterSpec, SpecError, load, resolve_path
from ..spec.diff import changed_fields
from .launchers import UpError, endpoint_timeout_args, launcher_for, ucx_net_devices_args
from .ray_follow import write_spec
from .procs import STOP_TIMEOUT_S, endpoint_name
from .state import ClusterState, clear_state, cluster_dir, read_state, read_token, write_state, write_token


AGENTS_REGISTER_TIMEOUT_S = 30.0  # default: every agent registered with the hub within this
STATUS_CALL_TIMEOUT_S = 1.0  # default: one status request while waiting for registrations
PROBE_CONNECT_TIMEOUT_S = 3.0  # default cap on an ssh connect when only asking "still running?"


class AlreadyRunning(Exception):
    pass


class ReconcileError(UpError):
    """A restart on a running cluster failed; what lived still lives."""


class SpecChanged(Exception):
    """``th up`` on a running cluster with another spec than the one it runs."""


@dataclass
class Reconciled:
    state: ClusterState
    restarted: list[str] = field(default_factory=list)  # "role@node (pid N)"
    left: list[str] = field(default_factory=list)


def _token(spec: ClusterSpec, spec_path: Path) -> str | None:
    if spec.auth.token:
        return spec.auth.token
    if spec.auth.token_file:
        return resolve_path(spec.auth.token_file, spec_path.resolve().parent).read_text().strip()
    return None


def hub_args(spec: ClusterSpec, state: ClusterState, launcher, token: str) -> list[str]:
    hub_node = spec.node(spec.hub.node)
    args = ["--bind", state.hub_address, "--token-file", launcher.token_path(hub_node, token),
            "--cluster", spec.name, "--expiry-s", str(spec.hub.expiry_s), "--muster-s", str(spec.hub.muster_s)]
    if spec.hub.metrics_port:
        args += ["--metrics-port", str(spec.hub.metrics_port), "--metrics-addr", hub_node.spec.address]
    for m in spec.models:
        args += ["--retain", f"{m.name}={m.retain.keep_latest}:{m.retain.min_reliable_copies}"]
        args += ["--deltas", f"{m.name}={m.deltas}"]
    return args


def agent_args(spec: ClusterSpec, state: ClusterState, launcher, node, token: str) -> list[str]:
    return ["--hub", state.hub_address, "--token-file", launcher.token_path(node, token), "--cluster", spec.name,
            "--node", node.name,
            "--address", node.spec.address, "--dc", node.dc, "--rack", node.rack,
            "--heartbeat-s", str(spec.hub.heartbeat_s), "--engine", spec.engine,
            *endpoint_timeout_args(spec), *ucx_net_devices_args(node)] + (["--spot"] if node.spec.spot else [])


def up(spec: ClusterSpec, spec_path: Path, timeout: float = AGENTS_REGISTER_TIMEOUT_S, log=print,
       call_timeout: float = STATUS_CALL_TIMEOUT_S) -> ClusterState | Reconciled:
    """A fresh cluster (its ``ClusterState``), or, when recorded processes of it still
    live, ``reconcile`` (a ``Reconciled``)."""
    d = cluster_dir(spec.name)
    from .ray_launcher import RayLauncherError
    from .ssh import SshError

    given, given_yaml = spec, None
    try:
        launcher = launcher_for(spec.launcher, spec, d)
        if spec.launcher == "ray":  # its nodes are the Ray cluster's, as it has them now
            given_yaml = spec_path.read_text()
            spec = launcher.resolve(given)
        old = read_state(spec.name)
        if old is not None:
            alive = [launcher.alive(r) for r in old.procs]
            if any(alive):
                return reconcile(spec, old, alive, launcher, timeout, log, call_timeout, given=given,
                                 given_yaml=given_yaml)
            log(f"cluster {spec.name!r}: clearing stale state of a cluster that is no longer running")
            clear_state(spec.name)
        problems = launcher.preflight()
    except SshError as exc:
        if isinstance(exc, RayLauncherError):
            raise UpError(str(exc)) from None
        raise UpError(f"cannot check the old cluster's processes: {exc}; run `th down -c {spec.name}`") from None
    finally:
        if "launcher" in locals():
            launcher.close()
    if problems:
        raise UpError("\n".join(problems))

    d.mkdir(parents=True, exist_ok=True)
    if given_yaml is not None:  # ray: the spec as written (reconcile compares it), and as resolved
        shutil.copyfile(spec_path, d / "given.yaml")
        write_spec(spec, d / "spec.yaml")
    else:
        shutil.copyfile(spec_path, d / "spec.yaml")
    write_token(spec.name, _token(spec, spec_path))
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
        token = read_token(spec.name)
        state.procs.append(launcher.start(hub_node, "hub", "tensorhub_cli.hub", hub_args(spec, state, launcher, token)))
        write_state(state)
        log(f"hub     {hub_node.name:<12} {state.hub_address}")
        lock = threading.Lock()

        def start_agent(node) -> None:
            args = agent_args(spec, state, launcher, node, token)
            rec = launcher.start(node, "agent", "tensorhub_cli.agent", args)
            with lock:
                state.procs.append(rec)
                write_state(state)
            log(f"agent   {node.name:<12} {node.spec.address:<15} {node.rack}/{node.dc}")

        with ThreadPoolExecutor(max(1, min(launcher.parallel, len(spec.nodes())))) as pool:
            futures = [pool.submit(start_agent, node) for node in spec.nodes()]
            problems = [str(f.exception()) for f in futures if f.exception() is not None]
        if problems:
            raise UpError("\n".join(problems))
        wait_registered(spec, state, launcher, timeout, call_timeout)
        start_runners(spec, state, log)
        if given_yaml is not None:
            launcher.follow(given_yaml)
            log(f"follow  Ray nodes that join or leave (every {spec.ray_or_default().follow_s:g}s)")
    except SshError as exc:
        down_state(state, launcher, log=lambda *_: None)
        raise UpError(str(exc)) from None
    except BaseException:
        down_state(state, launcher, log=lambda *_: None)
        raise
    finally:
        launcher.close()
    return state


def start_runners(spec: ClusterSpec, state: ClusterState, log=print) -> None:
    """The runners each role's ``count`` declares, through ``scale`` (placement,
    supervision, waiting for registration), once every agent is registered."""
    from . import scale

    for role, declared in spec.roles.items():
        if declared.count and role not in scale.CORE_ROLES:
            try:
                scale.run(spec.name, state, lambda op, change=f"{role}={declared.count}": op.scale(change), log=log)
            except scale.ScaleError as exc:
                raise UpError(f"roles.{role}.count: {exc}") from None


def finished(launcher, rec) -> dict | None:
    """The supervisor's outcome record of a dead runner that finished its work (exit
    0, so ``th up`` forgets it instead of restarting it), else None."""
    from ..agent.supervise import outcome_of

    outcome = outcome_of(launcher.log_tail(rec, 5), rec.pid)
    return outcome if outcome and outcome["exit"] == 0 and outcome["outcome"] in ("finished", "exited") else None


def reconcile(spec: ClusterSpec, state: ClusterState, alive: list[bool], launcher, timeout: float, log=print,
              call_timeout: float = STATUS_CALL_TIMEOUT_S, given: ClusterSpec | None = None,
              given_yaml: str | None = None) -> Reconciled:
    """Restart what died of a running cluster, leave what lives (module docstring).
    ``alive[i]``: whether ``state.procs[i]`` still runs. The caller closes
    ``launcher``. Launcher ``ray``: ``spec`` is resolved from the Ray nodes, ``given``
    is the spec as written (compared with the cluster's ``given.yaml``), and
    ``given_yaml`` its text: the follower is started again if it is gone."""
    from . import scale
    from .ssh import SshError

    d = cluster_dir(spec.name)
    copy = d / ("given.yaml" if given_yaml is not None else "spec.yaml")
    try:
        running = load(copy)
    except (OSError, SpecError) as exc:
        raise ReconcileError(f"cluster {spec.name!r} runs, but its spec copy {copy} is unreadable "
                             f"({exc}); stop it with `th down -c {spec.name}`") from None
    changes = changed_fields(running, given or spec)
    if changes:
        raise SpecChanged(f"cluster {spec.name!r} is running another spec: changed {', '.join(changes)}; "
                          f"nothing changed (to run this spec: `th down -c {spec.name}`, then `th up`)")
    if given_yaml is not None:  # ray: the nodes it has now; a lost follower starts again
        write_spec(spec, d / "spec.yaml")
        launcher.follow(given_yaml)
    dead = [r for r, ok in zip(state.procs, alive) if not ok]
    living = [r for r, ok in zip(state.procs, alive) if ok]
    done = [(r, finished(launcher, r)) for r in dead if r.role not in ("hub", "agent")]
    for rec, outcome in [(r, o) for r, o in done if o is not None]:
        dead.remove(rec)
        state.procs.remove(rec)
        log(f"forgot    {process_name(rec)} (pid {rec.pid}): it finished (exit 0, {outcome['restarts']} restarts)")
    if any(o is not None for _, o in done):
        write_state(state)
    hub_dead = not any(r.role == "hub" for r in state.procs) or any(r.role == "hub" for r in dead)
    agents_to_start = [n for n in spec.nodes() if not any(
        r.role == "agent" and r.node == n.name and r not in dead for r in state.procs)]
    if not dead and not agents_to_start:
        raise AlreadyRunning(f"cluster {spec.name!r} is already running: "
                             + ", ".join(f"{r.role}@{r.node} (pid {r.pid})" for r in state.procs))
    out = Reconciled(state, left=[f"{process_name(r)} (pid {r.pid})" for r in living])
    for what in out.left:
        log(f"left      {what}: running")

    def recorded(old, new) -> None:
        """``new`` replaces the dead ``old`` (None: ``new`` was missing) in the record."""
        if old is None:
            state.procs.insert(0 if new.role == "hub" else len(state.procs), new)
        else:
            state.procs[state.procs.index(old)] = new
        write_state(state)
        out.restarted.append(f"{process_name(new)} (pid {new.pid})")
        log(f"restarted {process_name(new)} (pid {new.pid}" + (f"; pid {old.pid} had died)" if old else ")"))

    token = read_token(spec.name)
    try:
        if hub_dead:
            problems = launcher.preflight()
            if problems:
                raise ReconcileError("cannot restart the hub: " + "; ".join(problems))
            new = launcher.start(spec.node(spec.hub.node), "hub", "tensorhub_cli.hub",
                                 hub_args(spec, state, launcher, token))
            recorded(next((r for r in dead if r.role == "hub"), None), new)
        else:  # a killed agent is listed alive until it expires; its successor could not register before
            wait_expired(state, [f"agent-{n.name}" for n in agents_to_start], call_timeout)
        for node in agents_to_start:
            new = launcher.start(node, "agent", "tensorhub_cli.agent", agent_args(spec, state, launcher, node, token))
            recorded(next((r for r in dead if r.role == "agent" and r.node == node.name), None), new)
        wait_registered(spec, state, launcher, timeout, call_timeout)
    except ReconcileError:
        raise
    except (SshError, UpError, RuntimeError) as exc:  # RuntimeError: a local start that exited at once
        raise ReconcileError(str(exc)) from None
    runners = [r for r in dead if r.role not in ("hub", "agent")]
    if runners:
        try:
            pairs = scale.run(spec.name, state, lambda op: op.restart(runners), log=lambda *_: None)
        except (scale.ScaleError, SshError) as exc:
            raise ReconcileError(f"runners not restarted: {exc}") from None
        for old, new in pairs:  # already recorded by the operator
            out.restarted.append(f"{process_name(new)} (pid {new.pid})")
            log(f"restarted {process_name(new)} (pid {new.pid}; pid {old.pid} had died)")
    return out


def process_name(rec) -> str:
    """``NAME@NODE`` of a recorded process, for the user: ``hub@node1``,
    ``agent@node2``, ``rollout-node2-1@node2``."""
    return f"{rec.role if rec.role in ('hub', 'agent') else endpoint_name(rec)}@{rec.node}"


def wait_expired(state: ClusterState, names: list[str], call_timeout: float = STATUS_CALL_TIMEOUT_S) -> None:
    """Until the hub lists none of ``names`` alive (dead processes it has not expired
    yet), at most twice its expiry plus a second; an unreachable hub is not waited for."""
    if not names:
        return
    client = HubClient(state.hub_address, read_token(state.cluster))
    deadline = time.monotonic() + 2 * state.expiry_s + 1.0
    try:
        while time.monotonic() < deadline:
            try:
                status = client.call(p.Status(), timeout=call_timeout)
            except (HubUnreachable, HubError):
                return
            if not {e.name for e in status.endpoints if e.alive} & set(names):
                return
            time.sleep(0.1)
    finally:
        client.close()


def wait_registered(spec: ClusterSpec, state: ClusterState, launcher, timeout: float,
                    call_timeout: float = STATUS_CALL_TIMEOUT_S) -> None:
    """Until every node's agent is alive at the hub, at most ``timeout`` seconds; each
    status request waits at most ``call_timeout``."""
    want = {f"agent-{n.name}": n.name for n in spec.nodes()}
    client = HubClient(state.hub_address, read_token(spec.name))
    deadline = time.monotonic() + timeout
    missing = set(want)
    next_check = 0.0
    try:
        hub = next(r for r in state.procs if r.role == "hub")
        while time.monotonic() < deadline:
            if time.monotonic() >= next_check:  # over ssh each check is a round trip
                next_check = time.monotonic() + 1.0
                if not launcher.alive(hub):
                    raise UpError(f"hub exited during start-up; its log ends:\n{launcher.log_tail(hub)}")
            try:
                status = client.call(p.Status(), timeout=call_timeout)
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
            state_word = "running" if launcher.alive(rec) else "exited"
            lines.append(f"--- {rec.node} agent ({state_word}; {rec.log}):\n{launcher.log_tail(rec)}")
    raise UpError("\n".join(lines))


def down_state(state: ClusterState, launcher, log=print,
               stop_timeout: float = STOP_TIMEOUT_S) -> list[tuple[str, str, str]]:
    """Runners first, then agents (each batch in parallel, so they can deregister while
    the hub is up), then the hub; each gets ``stop_timeout`` seconds before SIGKILL."""
    runners = [r for r in state.procs if r.role not in ("hub", "agent")]
    agents = [r for r in state.procs if r.role == "agent"]
    hubs = [r for r in state.procs if r.role == "hub"]
    results = []
    try:
        if hasattr(launcher, "before_down"):  # ray: its follower must not fail over what we stop
            launcher.before_down()
        for batch in (runners, agents, hubs):
            if not batch:
                continue
            with ThreadPoolExecutor(max(1, min(launcher.parallel, len(batch)))) as pool:
                outcomes = list(pool.map(lambda rec: launcher.stop(rec, timeout=stop_timeout), batch))
            for rec, outcome in zip(batch, outcomes):
                results.append((rec.role, rec.node, outcome))
                log(f"{rec.role:<7} {rec.node:<12} {outcome}")
                if rec.role == "agent" and outcome != "stopped":  # a clean exit cleared its own store
                    _clear_store(state, launcher, rec, log)
        if hasattr(launcher, "after_down"):  # ray: no actor of the cluster outlives it
            for name in launcher.after_down():
                log(f"actor   {name:<12} killed (left unrecorded)")
    finally:
        launcher.close()
    if all(not outcome.startswith("unknown") for *_, outcome in results):
        clear_state(state.cluster)
    return results


def _clear_store(state: ClusterState, launcher, rec, log) -> None:
    """The copies a dead agent left in its store (``agent.store``): nobody adopts them
    once the cluster is down."""
    from ..agent.store import StoreError, agent_dir
    from .ssh import SshError

    try:
        launcher.remove_tree(rec.node, str(agent_dir(f"agent-{rec.node}", state.hub_address, state.cluster)))
    except (StoreError, SshError, OSError) as exc:
        log(f"agent   {rec.node:<12} its store was not cleared: {exc}")


def down(name: str, log=print, stop_timeout: float = STOP_TIMEOUT_S) -> list[tuple[str, str, str]]:
    state = read_state(name)
    if state is None:
        raise LookupError(f"cluster {name!r} is not running (no state under {cluster_dir(name)})")
    return down_state(state, launcher_for(state.launcher, None, cluster_dir(name)), log=log,
                      stop_timeout=stop_timeout)


def proc_key(rec) -> tuple[str, str]:
    """How ``processes_alive`` names a record: (role, node), or (role, name) for a
    runner with a name of its own (a node's second runner of a role)."""
    return (rec.role, rec.name) if rec.name else (rec.role, rec.node)


def processes_alive(name: str, state: ClusterState,
                    connect_timeout: float = PROBE_CONNECT_TIMEOUT_S) -> dict[tuple[str, str], bool | None]:
    """``proc_key(rec)`` ((role, node); a named runner: (role, name)) → is the recorded
    process still ours; None when it cannot be told
    (its node unreachable). Checked in parallel: over ssh each is a round trip, and an
    unreachable node costs at most ``connect_timeout``, not the spec's full one."""
    from .ssh import SshError

    launcher = launcher_for(state.launcher, None, cluster_dir(name), connect_timeout=connect_timeout)

    def check(rec) -> bool | None:
        try:
            return launcher.alive(rec)
        except SshError:
            return None

    try:
        with ThreadPoolExecutor(max(1, min(launcher.parallel, len(state.procs) or 1))) as pool:
            return dict(zip(map(proc_key, state.procs), pool.map(check, state.procs)))
    finally:
        launcher.close()
