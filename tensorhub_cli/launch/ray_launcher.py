"""Ray launcher: the hub and agents as detached actors on an existing Ray cluster.

Protocol. The launcher joins the Ray cluster the spec names (``ray.address``, default
``auto``: the cluster this machine is a node of; ``th`` runs as a Ray driver, so on a
node of the cluster) in the spec's ``ray.namespace``. ``resolve`` turns the spec as
written into the one it runs (``ray_nodes``: one node per live Ray node). ``start``
creates a ``ray_actors.ProcessActor`` named ``<cluster>.<process name>``, detached,
with 0 CPUs and hard node-affinity to the node's Ray node id, and returns a
``ProcRecord`` of its process (pid, start time, log on that node): the same record the
local and ssh launchers keep, so ``th down/status/logs/scale/failover`` and ``th up``'s
reconcile work unchanged. ``alive``, ``stop`` (SIG``sig``, then SIGKILL after
``timeout``, then the actor is killed), ``log_tail``, ``logs`` and ``remove_tree`` go
through the actor; an actor that is gone (killed, or its node left) is a process that
is not running. The token reaches a node inside the actor's constructor (its
``{NODE_DIR}/token``, 0600), never in a command line.

``follow(given_yaml)`` starts (or keeps) the cluster's ``Follower`` on this node;
``before_down`` stops it before anything else stops (it would fail over the nodes
``th down`` empties), ``after_down`` kills every actor of the cluster still named in
the namespace (one a race left unrecorded), so ``th down`` leaves no actor behind.

Errors are ``RayLauncherError``, an ``SshError``: the cluster code treats one as it
treats a node it cannot reach (``unknown``, kept recorded), whatever the launcher.
Every Ray call has a timeout (``ray.start_timeout_s`` for a start, ``CALL_TIMEOUT_S``
for the rest).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from ..spec import ClusterSpec, PlacedNode, load
from .procs import STOP_TIMEOUT_S, ProcRecord
from .ray_nodes import RAY_NODE_ID, resolve
from .ssh import SshError

CALL_TIMEOUT_S = 15.0  # default limit of one call to an actor or to Ray
CONNECT_TIMEOUT_S = 10.0  # default limit of reaching the Ray head's GCS port
KILL_WAIT_S = 10.0  # how long a killed actor's name may take to be free again
FOLLOWER = "follow"


_REMOTE: dict = {}


def _remote(ray, cls):
    """``ray.remote(cls)``, made once per process (each makes a new actor class)."""
    if cls not in _REMOTE:
        _REMOTE[cls] = ray.remote(cls)
    return _REMOTE[cls]


class RayLauncherError(SshError):
    """A Ray call failed; worded for the user (names the node or actor)."""


def ray_module():
    try:
        import ray
    except ImportError:
        raise RayLauncherError("launcher 'ray' needs Ray: pip install 'tensorhub-ros[ray]'") from None
    return ray


def _reachable(address: str, timeout: float) -> None:
    """A HOST:PORT address must accept a TCP connection within ``timeout`` seconds:
    ``ray.init`` retries an unreachable GCS for minutes without a word."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # 'auto' and other forms: ray.init itself fails at once
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RayLauncherError(f"ray.address {address!r}: no Ray head answers there ({exc.strerror or exc}) within "
                               f"{timeout:.0f}s; `ray status` on a node of the cluster shows its address") from None


def join(address: str, namespace: str, timeout: float = CONNECT_TIMEOUT_S):
    """``ray`` connected to the cluster at ``address`` (a driver of this process), in
    ``namespace``; a process already connected (a Ray worker) keeps its connection.
    An address nobody answers at fails within ``timeout`` seconds."""
    ray = ray_module()
    if not ray.is_initialized():
        _reachable(address, timeout)
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR",
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayLauncherError(f"cannot join the Ray cluster at {address!r}: {exc}; is this machine a node "
                                   "of it (`ray status`)? `ray start --address HEAD:6379` makes it one") from None
    return ray


class RayLauncher:
    parallel = 8

    def __init__(self, spec: ClusterSpec | None, state_dir: Path):
        """``spec``: as given (``resolve`` next) or resolved; None: the cluster's own copy."""
        self.spec = spec if spec is not None else load(state_dir / "spec.yaml")
        self.state_dir = state_dir
        self.config = self.spec.ray_or_default()
        self.ray = join(self.config.address, self.config.namespace)
        self._token: str | None = None

    # --- names --------------------------------------------------------------------

    def actor_name(self, what: str) -> str:
        return f"{self.spec.name}.{what}"

    def _actor(self, what: str):
        try:
            return self.ray.get_actor(self.actor_name(what), namespace=self.config.namespace)
        except ValueError:
            return None

    def _get(self, ref, what: str, timeout: float = CALL_TIMEOUT_S):
        ray = self.ray
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RayLauncherError(f"{what}: no answer within {timeout:.0f}s") from None

    # --- the launcher interface --------------------------------------------------------

    def resolve(self, given: ClusterSpec) -> ClusterSpec:
        """The spec with the Ray cluster's live nodes (``ray_nodes.resolve``); kept as ours."""
        from .ray_nodes import RayNodesError

        try:
            self.spec = resolve(given, self.ray.nodes())
        except RayNodesError as exc:
            raise RayLauncherError(str(exc)) from None
        return self.spec

    def preflight(self) -> list[str]:
        live = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
        return [f"{n.name}: Ray node {n.spec.labels.get(RAY_NODE_ID)} is not alive" for n in self.spec.nodes()
                if n.spec.labels.get(RAY_NODE_ID) not in live]

    def token_path(self, node: PlacedNode, token: str) -> str:
        self._token = token  # written by the actor that starts the process (``start``)
        return "{NODE_DIR}/token"

    def node_dir(self, node: str) -> str:
        return f"~/.tensorhub/{self.spec.name}/nodes/{node}"

    def start(self, node: PlacedNode, role: str, module: str, args: list[str], name: str | None = None) -> ProcRecord:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .ray_actors import ProcessActor

        ray = self.ray
        proc_name = name or f"{role}-{node.name}"
        boot = node.spec.bootstrap
        argv = [boot.python if boot and boot.python else "{PYTHON}", "-m", module, *args]
        self._kill(proc_name)
        strategy = NodeAffinitySchedulingStrategy(node_id=node.spec.labels[RAY_NODE_ID], soft=False)
        deadline = time.monotonic() + KILL_WAIT_S
        while True:
            try:
                actor = _remote(ray, ProcessActor).options(
                    name=self.actor_name(proc_name), namespace=self.config.namespace, lifetime="detached",
                    num_cpus=0, max_restarts=0, max_concurrency=4, scheduling_strategy=strategy,
                ).remote(argv, "{NODE_DIR}/" + proc_name + ".log", self.node_dir(node.name), self._token)
                break
            except ValueError as exc:  # the name of an actor just killed is not free yet
                if time.monotonic() > deadline:
                    raise RayLauncherError(f"{node.name}: actor {self.actor_name(proc_name)}: {exc}") from None
                time.sleep(0.2)
        try:
            info = self._get(actor.info.remote(), f"{node.name}: starting {proc_name}", self.config.start_timeout_s)
        except ray.exceptions.RayActorError as exc:
            self._kill(proc_name)
            raise RayLauncherError(f"{node.name}: could not start {proc_name}: {exc}") from None
        except RayLauncherError:
            self._kill(proc_name)
            raise
        return ProcRecord(role=role, node=node.name, pid=info["pid"], starttime=info["starttime"], marker=module,
                          log=info["log"])

    def _proc_actor(self, rec: ProcRecord):
        return self._actor(rec.name or f"{rec.role}-{rec.node}")

    def _matches(self, actor, rec: ProcRecord) -> bool:
        info = self._get(actor.info.remote(), f"{rec.node}: {rec.role}")
        return info["pid"] == rec.pid and info["starttime"] == rec.starttime and info["exit"] is None

    def alive(self, rec: ProcRecord) -> bool:
        actor = self._proc_actor(rec)
        if actor is None:
            return False
        try:
            return self._matches(actor, rec)
        except self.ray.exceptions.RayActorError:
            return False

    def stop(self, rec: ProcRecord, timeout: float = STOP_TIMEOUT_S, sig: str = "TERM") -> str:
        if sig not in ("TERM", "USR1"):
            raise ValueError(f"signal {sig!r}: only TERM or USR1")
        ray = self.ray
        actor = self._proc_actor(rec)
        if actor is None:
            return "not running"
        try:
            if not self._matches(actor, rec):
                how = "not running"
            elif not self._get(actor.signal.remote(sig), f"{rec.node}: signalling {rec.role}"):
                how = "stopped"
            elif self._get(actor.wait.remote(timeout), f"{rec.node}: {rec.role} stopping", timeout + CALL_TIMEOUT_S):
                how = "stopped"
            else:
                self._get(actor.signal.remote("KILL"), f"{rec.node}: killing {rec.role}")
                how = "killed"
        except ray.exceptions.RayActorError:
            how = "not running"
        except RayLauncherError as exc:
            return f"unknown: {exc}"
        ray.kill(actor)  # the process has ended (or dies with it): its actor goes too
        return how

    def log_tail(self, rec: ProcRecord, lines: int = 8) -> str:
        actor = self._proc_actor(rec)
        if actor is None:
            return f"(log unreadable: actor {self.actor_name(rec.name or f'{rec.role}-{rec.node}')} is gone)"
        try:
            return self._get(actor.tail.remote(lines), f"{rec.node}: log of {rec.role}")
        except (self.ray.exceptions.RayActorError, RayLauncherError) as exc:
            return f"(log unreadable: {exc})"

    def logs(self, rec: ProcRecord, lines: int, follow: bool, write) -> None:
        actor = self._proc_actor(rec)
        if actor is None:
            raise RayLauncherError(f"{rec.node}: the actor of {rec.role} is gone (its node left?)")
        write(self.log_tail(rec, lines) + "\n")
        if not follow:
            return
        offset = self._size(actor, rec)
        while True:
            text, offset = self._get(actor.read.remote(offset), f"{rec.node}: log of {rec.role}")
            if text:
                write(text)
            else:
                time.sleep(0.2)

    def _size(self, actor, rec: ProcRecord) -> int:
        """The log's current length (where ``--follow`` starts)."""
        offset = 0
        while True:
            text, after = self._get(actor.read.remote(offset), f"{rec.node}: log of {rec.role}")
            if not text:
                return offset
            offset = after

    def remove_tree(self, node: str, path: str) -> None:
        actor = self._actor(f"agent-{node}")
        if actor is not None:
            try:
                self._get(actor.remove_tree.remote(path), f"{node}: removing {path}")
            except self.ray.exceptions.RayActorError:
                pass

    def close(self) -> None:
        pass  # the Ray connection is the process's; it ends with it

    # --- actors beyond processes ----------------------------------------------------

    def _kill(self, what: str) -> None:
        actor = self._actor(what)
        if actor is not None:
            self.ray.kill(actor)

    def follow(self, given_yaml: str) -> None:
        """Start the cluster's ``Follower`` on this node, unless one runs."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .ray_actors import Follower
        from .state import th_home

        old = self._actor(FOLLOWER)
        if old is not None:
            try:
                self._get(old.ping.remote(), "the follower")
                return
            except (self.ray.exceptions.RayActorError, RayLauncherError):
                self.ray.kill(old)
        here = self.ray.get_runtime_context().get_node_id()
        actor = _remote(self.ray, Follower).options(
            name=self.actor_name(FOLLOWER), namespace=self.config.namespace, lifetime="detached", num_cpus=0,
            max_restarts=0, max_concurrency=4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(self.spec.name, str(th_home()), given_yaml)
        self._get(actor.ping.remote(), "starting the follower", self.config.start_timeout_s)

    def before_down(self) -> None:
        follower = self._actor(FOLLOWER)
        if follower is not None:
            try:
                self._get(follower.stop.remote(), "stopping the follower")
            except (self.ray.exceptions.RayActorError, RayLauncherError):
                pass
            self.ray.kill(follower)

    def after_down(self) -> list[str]:
        """Kill every actor of this cluster still named in the namespace; their names."""
        from ray.util import list_named_actors

        prefix = f"{self.spec.name}."
        left = [a["name"] for a in list_named_actors(all_namespaces=True)
                if a["namespace"] == self.config.namespace and a["name"].startswith(prefix)]
        for name in left:
            self._kill(name[len(prefix):])
        return left
