"""`th scale` and `th failover`: runners started and stopped on a running cluster.

A runner is a process of a role in the spec (``roles:``): ``runners.trainer`` for
``trainer``, ``runners.rollout`` for ``rollout``, or the module ``runner.command``
names, with ``runner.args`` after ours (place, hub, heartbeat and the spec's
``endpoints`` read/plan timeouts: ``runners.common.add_common`` takes them all). It
is started by the cluster's launcher (local or ssh) like an agent, recorded in
``state.json`` (so ``th down`` stops it by PID), and named as an endpoint
``ROLE-NODE``, or ``ROLE-NODE-I`` for the I-th further runner of the role on a node
(the lowest index no recorded runner and no live endpoint uses): one name, one
process, one log file (over ssh, one pid file).

Protocol of ``scale(ROLE=COUNT | ROLE+N | ROLE-N)``:

- up: pick nodes the role's ``select`` allows, whose agent is alive, with room (a
  node runs at most ``max(1, gpus)`` runners), fewest runners first, then in the order
  ``select.nodes`` lists them, a node taking a second runner once every candidate
  has one more; wait until each has registered with the hub *under the name it was
  started with*. If any fails (it exits, e.g. refused because its name is taken, or
  does not register in time), the ones this call started are stopped again and the
  error shows the failed one's log tail: all or nothing.
- down: stop the newest runners of the role with SIGTERM and a long grace: a runner
  closes its endpoint, which unpublishes each replica with drain, and retention pulls
  a copy first where the policy needs one (contract 4), so leaving loses nothing.

Protocol of ``failover(NODE, replace_with)``: stop the node's runners (drained as
above), then ask its agent to drain its host copies and leave (SIGUSR1), then start
each stopped runner's role again on ``replace_with`` or any node with room. The report
lists what moved; every READY version stays READY throughout, as long as another
live endpoint can hold a copy. An agent that had already died cannot drain: it is
reported ``gone``, with the copies the hub still listed for it as ``lost``. Either way
the node's agent record is dropped, so the node is out of service (``th status`` says
so) until ``th up SPEC`` on the running cluster reconciles it: an agent missing from
the record is started again like one that died.

Both record a ``scaled`` / ``failed_over`` event in the hub's log (``th status``).

Limits: a leaving endpoint (runner on scale-down or failover, agent on failover) gets
``endpoints.drain_timeout_s`` from the spec for each replica the hub says it holds (at
least one) between its signal and SIGKILL; ``Operator``/``run`` take an override, and
the limits of registration, hub requests and rollback, each with a default below.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable
from ..spec import ClusterSpec, PlacedNode, load
from ..agent.supervise import exited_line, restart_args
from .launchers import endpoint_timeout_args, launcher_for, ucx_net_devices_args
from .procs import ProcRecord, endpoint_name
from .state import ClusterState, cluster_dir, read_token, write_state

MODULES = {"trainer": "runners.trainer", "rollout": "runners.rollout"}
SUPERVISOR = "tensorhub_cli.agent.supervise"  # every runner runs under one (``_launch``)
CORE_ROLES = ("hub", "agent")
REGISTER_TIMEOUT_S = 120.0  # default: a runner imports torch (and transformers) before it registers
CALL_TIMEOUT_S = 5.0  # default limit of one request to the hub
ROLLBACK_TIMEOUT_S = 10.0  # default grace of a runner stopped because its start failed: it holds nothing yet


class ScaleError(Exception):
    pass


class BadInput(ScaleError):
    """The request names something the cluster does not have (exit 2, not 1)."""


@dataclass
class Change:
    role: str
    target: int


@dataclass
class Outcome:
    started: list[str] = field(default_factory=list)  # endpoint names: "role-node" or "role-node-i"
    stopped: list[str] = field(default_factory=list)
    drained: list[str] = field(default_factory=list)  # agents that drained their copies
    gone: list[str] = field(default_factory=list)  # failover: agents already dead, nothing drained
    lost: list[str] = field(default_factory=list)  # failover: the copies the hub said those held

    def as_dict(self) -> dict:
        """``gone`` and ``lost`` only when a failover found its agent dead (the keys
        scripts read before they existed stay as they were)."""
        done = {"started": self.started, "stopped": self.stopped, "drained": self.drained}
        return {**done, "gone": self.gone, "lost": self.lost} if self.gone else done


def parse_change(text: str, spec: ClusterSpec, current: dict[str, int]) -> Change:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*([=+-])\s*(\d+)", text.strip())
    if not m:
        raise BadInput(f"{text!r}: expected ROLE=COUNT, ROLE+N or ROLE-N (e.g. rollout=4)")
    role, op, n = m.group(1), m.group(2), int(m.group(3))
    if role in CORE_ROLES:
        raise BadInput(f"{role!r}: the cluster's own processes are not scaled; `th up`/`th down` manage them")
    if role not in spec.roles:
        raise BadInput(f"role {role!r} is not in the spec's roles (roles: {', '.join(sorted(spec.roles)) or 'none'})")
    if role not in MODULES and spec.roles[role].runner is None:
        raise BadInput(f"roles.{role}.runner: no runner module for role {role!r}; set runner.command")
    have = current.get(role, 0)
    target = n if op == "=" else have + n if op == "+" else have - n
    if target < 0:
        raise BadInput(f"{text}: {role} has {have} runner(s); cannot go below 0")
    return Change(role, target)


def runner_name(role: str, node: str, index: int) -> str:
    return f"{role}-{node}" if index == 0 else f"{role}-{node}-{index}"


def _runners(state: ClusterState) -> list[ProcRecord]:
    return [r for r in state.procs if r.role not in CORE_ROLES]


def _allowed(spec: ClusterSpec, role: str, node: PlacedNode) -> bool:
    sel = spec.roles[role].select
    if sel.nodes is not None and node.spec.name not in sel.nodes:
        return False
    return all(node.spec.labels.get(k) == v for k, v in (sel.labels or {}).items())


def _room(node: PlacedNode, state: ClusterState) -> int:
    return max(1, node.spec.gpus) - sum(r.node == node.spec.name for r in _runners(state))


class Operator:
    """One `th scale`/`th failover` call: the cluster's spec, state, launcher and hub."""

    def __init__(self, name: str, state: ClusterState, log=print, *, drain_timeout: float | None = None,
                 register_timeout: float = REGISTER_TIMEOUT_S, call_timeout: float = CALL_TIMEOUT_S,
                 rollback_timeout: float = ROLLBACK_TIMEOUT_S):
        """``drain_timeout`` (per replica) defaults to the spec's ``endpoints.drain_timeout_s``."""
        self.name, self.state, self.log = name, state, log
        self.spec = load(cluster_dir(name) / "spec.yaml")
        self.drain_timeout = self.spec.endpoints.drain_timeout_s if drain_timeout is None else drain_timeout
        self.register_timeout = register_timeout
        self.call_timeout = call_timeout
        self.rollback_timeout = rollback_timeout
        self.launcher = launcher_for(state.launcher, self.spec, cluster_dir(name))
        self.token = read_token(name)
        self.hub = HubClient(state.hub_address, self.token)

    def close(self) -> None:
        self.hub.close()
        self.launcher.close()

    def status(self) -> p.StatusReply:
        try:
            return self.hub.call(p.Status(), timeout=self.call_timeout)
        except (HubUnreachable, HubError) as exc:
            raise ScaleError(f"hub at {self.state.hub_address}: {exc}") from None

    def note(self, kind: str, message: str, endpoint: str = "") -> None:
        try:
            self.hub.call(p.Note(kind=kind, message=message, endpoint=endpoint), timeout=self.call_timeout)
        except (HubUnreachable, HubError) as exc:
            self.log(f"(event not recorded at the hub: {exc})")

    def prune(self) -> None:
        """Forget runners that exited on their own (a trainer that finished): they hold
        no room and nothing to stop."""
        gone = [r for r in _runners(self.state) if not self.launcher.alive(r)]
        for rec in gone:
            self.state.procs.remove(rec)
            self.log(f"{rec.role:<8} {rec.node:<12} {endpoint_name(rec)} had exited (pid {rec.pid}); forgotten")
        if gone:
            write_state(self.state)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in _runners(self.state):
            out[r.role] = out.get(r.role, 0) + 1
        return out

    # --- starting ----------------------------------------------------------------

    def _args(self, role: str, node: PlacedNode, name: str) -> tuple[str, list[str]]:
        runner = self.spec.roles[role].runner
        module = runner.command if runner else MODULES[role]
        args = ["--hub", self.state.hub_address, "--token-file", self.launcher.token_path(node, self.token),
                "--name", name, "--node", node.spec.name, "--host", node.spec.address,
                "--dc", node.dc, "--rack", node.rack, "--engine", self.spec.engine,
                "--heartbeat-s", str(self.spec.hub.heartbeat_s), *endpoint_timeout_args(self.spec),
                *ucx_net_devices_args(node)]
        if role == "rollout" and node.spec.spot:
            args.append("--spot")
        return module, args + (runner.args if runner else [])

    def _launch(self, role: str, node: PlacedNode, name: str) -> ProcRecord:
        """Start runner ``name`` under its supervisor (``agent.supervise``), which
        restarts it by the role's ``restart`` policy; the record is the supervisor's."""
        module, args = self._args(role, node, name)
        supervised = ["--name", name, *restart_args(self.spec.roles[role].restart), "--hub", self.state.hub_address,
                      "--token-file", self.launcher.token_path(node, self.token), "--", module, *args]
        return self.launcher.start(node, role, SUPERVISOR, supervised, name=name)

    def _candidates(self, role: str, alive_agents: set[str], exclude: set[str] = frozenset()) -> list[PlacedNode]:
        nodes = [n for n in self.spec.nodes() if n.spec.name not in exclude and _allowed(self.spec, role, n)
                 and n.spec.name in alive_agents and _room(n, self.state) > 0]
        # Least busy first; among equals, the order ``select.nodes`` lists (else the spec's).
        order = self.spec.roles[role].select.nodes or [n.spec.name for n in self.spec.nodes()]
        busy = {n.spec.name: sum(r.node == n.spec.name for r in _runners(self.state)) for n in nodes}
        return sorted(nodes, key=lambda n: (busy[n.spec.name], order.index(n.spec.name)))

    def _place(self, role: str, count: int, alive_agents: set[str]) -> list[PlacedNode]:
        """Up to ``count`` slots, one node per runner: each goes to the least busy
        candidate with room left (so a node with room for two takes a second runner
        only once every candidate has one more)."""
        nodes = self._candidates(role, alive_agents)
        order = self.spec.roles[role].select.nodes or [n.spec.name for n in self.spec.nodes()]
        busy = {n.spec.name: sum(r.node == n.spec.name for r in _runners(self.state)) for n in nodes}
        room = {n.spec.name: _room(n, self.state) for n in nodes}
        out: list[PlacedNode] = []
        for _ in range(count):
            free = [n for n in nodes if room[n.spec.name] > 0]
            if not free:
                break
            best = min(free, key=lambda n: (busy[n.spec.name], order.index(n.spec.name)))
            out.append(best)
            busy[best.spec.name] += 1
            room[best.spec.name] -= 1
        return out

    def _free_name(self, role: str, node: str, live: set[str]) -> str:
        """The lowest-index name of ``role`` on ``node`` that no recorded process and
        no live endpoint at the hub uses: two processes under one name would have the
        second refused (``conflict``), and scale would take the first for it."""
        taken = {endpoint_name(r) for r in self.state.procs} | live
        index = 0
        while runner_name(role, node, index) in taken:
            index += 1
        return runner_name(role, node, index)

    def start(self, role: str, nodes: list[PlacedNode]) -> list[ProcRecord]:
        """Start one runner per entry of ``nodes`` (a node may appear more than once),
        each under a free name, and wait for each to register; all or nothing."""
        started: list[ProcRecord] = []
        try:
            live = {e.name for e in self.status().endpoints if e.alive}
            for node in nodes:
                name = self._free_name(role, node.spec.name, live)
                rec = self._launch(role, node, name)
                if name != f"{role}-{node.spec.name}":
                    rec.name = name
                started.append(rec)
                self.state.procs.append(rec)
                write_state(self.state)
                self.log(f"{role:<8} {node.spec.name:<12} started {name} (pid {rec.pid})")
            self._await_registered(started)
        except BaseException:
            for rec in started:
                self.launcher.stop(rec, timeout=self.rollback_timeout)
                self.state.procs.remove(rec)
            write_state(self.state)
            raise
        return started

    def restart(self, recs: list[ProcRecord]) -> list[tuple[ProcRecord, ProcRecord]]:
        """Start each recorded runner in ``recs`` (dead ones) again, on its node under its
        name, replacing its record, and wait until each registered: (old, new) pairs.
        All or nothing: on a failure the new ones are stopped and the old records put
        back (a later `th up` retries them)."""
        names = {endpoint_name(r) for r in recs}
        deadline = time.monotonic() + 2 * self.state.expiry_s + 1.0
        while names & {e.name for e in self.status().endpoints if e.alive}:  # the dead not expired yet
            if time.monotonic() > deadline:
                held = sorted(names & {e.name for e in self.status().endpoints if e.alive})
                raise ScaleError(f"{', '.join(held)}: still held by a live endpoint at the hub; not restarted")
            time.sleep(0.1)
        pairs: list[tuple[ProcRecord, ProcRecord]] = []
        try:
            for old in recs:
                node = self.spec.node(old.node)
                new = self._launch(old.role, node, endpoint_name(old))
                new.name = old.name
                self.state.procs[self.state.procs.index(old)] = new
                pairs.append((old, new))
                write_state(self.state)
            self._await_registered([new for _, new in pairs])
        except BaseException:
            for old, new in pairs:
                self.launcher.stop(new, timeout=self.rollback_timeout)
                self.state.procs[self.state.procs.index(new)] = old
            write_state(self.state)
            raise
        return pairs

    def _await_registered(self, recs: list[ProcRecord]) -> None:
        want = {endpoint_name(r): r for r in recs}
        deadline = time.monotonic() + self.register_timeout
        while want:
            seen = {e.name for e in self.status().endpoints if e.alive}
            want = {n: r for n, r in want.items() if n not in seen}
            for name, rec in want.items():
                # Its supervisor would restart it, but a runner that dies before it ever
                # registered is a bad start (arguments, imports): fail now, all or nothing.
                if not self.launcher.alive(rec) or exited_line(name, rec.pid) in self.launcher.log_tail(rec, 40):
                    raise ScaleError(f"{name} exited before registering; its log ends:\n{self.launcher.log_tail(rec)}")
            if want and time.monotonic() > deadline:
                raise ScaleError(f"{', '.join(sorted(want))}: not registered within {self.register_timeout:.0f}s")
            time.sleep(0.2)

    # --- stopping ----------------------------------------------------------------

    def drain_grace(self, rec: ProcRecord) -> float:
        """How long ``rec`` may take to leave: ``drain_timeout`` for each replica its
        endpoint holds, as the hub sees it now (at least one, and one when the hub
        cannot be asked: a lost hub has no drain to wait for)."""
        try:
            endpoints = self.status().endpoints
        except ScaleError:
            return self.drain_timeout
        held = next((e.replicas for e in endpoints if e.name == endpoint_name(rec)), 0)
        return self.drain_timeout * max(1, held)

    def stop(self, recs: list[ProcRecord], sig: str = "TERM") -> list[str]:
        out = []
        for rec in recs:
            how = self.launcher.stop(rec, timeout=self.drain_grace(rec), sig=sig)
            if how.startswith("unknown"):
                raise ScaleError(f"{rec.role} on {rec.node}: {how}; it stays recorded")
            self.state.procs.remove(rec)
            write_state(self.state)
            self.log(f"{rec.role:<8} {rec.node:<12} {endpoint_name(rec)} {how}")
            out.append(endpoint_name(rec))
        return out

    # --- the two commands --------------------------------------------------------------

    def scale(self, text: str) -> Outcome:
        self.prune()
        change = parse_change(text, self.spec, self.counts())
        mine = [r for r in _runners(self.state) if r.role == change.role]
        outcome = Outcome()
        if change.target > len(mine):
            alive = {e.node for e in self.status().endpoints if e.kind == "agent" and e.alive}
            nodes = self._place(change.role, change.target - len(mine), alive)
            if len(nodes) < change.target - len(mine):
                raise ScaleError(f"{change.role}: {change.target - len(mine)} more wanted, room for {len(nodes)} "
                                 "(select, live agent, at most max(1, gpus) runners per node); nothing started")
            outcome.started = [endpoint_name(r) for r in self.start(change.role, nodes)]
        elif change.target < len(mine):
            outcome.stopped = self.stop(mine[change.target:][::-1])
        self.note("scaled", f"{change.role}: {len(mine)} -> {change.target}; started {outcome.started or '-'}, "
                            f"stopped {outcome.stopped or '-'}")
        return outcome

    def failover(self, node: str, replace_with: str | None) -> Outcome:
        names = {n.spec.name for n in self.spec.nodes()}
        if node not in names:
            raise BadInput(f"node {node!r} is not in cluster {self.name!r} (nodes: {', '.join(sorted(names))})")
        if replace_with is not None and replace_with not in names:
            raise BadInput(f"--replace-with: node {replace_with!r} is not in cluster {self.name!r}")
        if replace_with == node:
            raise BadInput("--replace-with: must be another node than the one failed over")
        self.prune()
        outcome = Outcome()
        runners = [r for r in _runners(self.state) if r.node == node]
        status = self.status()  # before anything stops: what the node's agent holds, as the hub sees it
        alive = {e.node for e in status.endpoints if e.kind == "agent" and e.alive} - {node}
        # Where each role goes, decided before anything stops: a failover that cannot
        # place its runners changes nothing.
        plan: list[tuple[str, PlacedNode]] = []
        taken: dict[str, int] = {}
        for rec in runners:
            pool = [self.spec.node(replace_with)] if replace_with else self._candidates(rec.role, alive, {node})
            pool = [n for n in pool if _allowed(self.spec, rec.role, n) and n.spec.name in alive
                    and _room(n, self.state) - taken.get(n.spec.name, 0) > 0]
            if not pool:
                raise ScaleError(f"{rec.role} on {node}: no live node with room to take it "
                                 f"({'--replace-with ' + replace_with if replace_with else 'none selectable'}); "
                                 "nothing changed")
            plan.append((rec.role, pool[0]))
            taken[pool[0].spec.name] = taken.get(pool[0].spec.name, 0) + 1
        outcome.stopped = self.stop(runners)
        agent = next((r for r in self.state.procs if r.role == "agent" and r.node == node), None)
        if agent is None:
            self.log(f"agent    {node:<12} none recorded: the node was already out of service")
        elif self._agent_dead(agent):
            outcome.gone = [f"agent-{node}"]
            outcome.lost = _copies_held(status, f"agent-{node}")
            self.state.procs.remove(agent)
            write_state(self.state)
            self.log(f"agent    {node:<12} agent-{node} was already gone (pid {agent.pid} had exited): nothing "
                     "could drain; " + (f"lost its copies {', '.join(outcome.lost)}" if outcome.lost else
                                        "the hub listed no copies for it (none held, or it had expired already: "
                                        "see `th versions` for UNAVAILABLE versions)"))
        else:
            self.log(f"agent    {node:<12} draining its copies (retention pulls elsewhere first) …")
            self.stop([agent], sig="USR1")
            outcome.drained = [f"agent-{node}"]
        for role, target in plan:
            outcome.started += [endpoint_name(r) for r in self.start(role, [target])]
        self.note("failed_over", f"{node}: stopped {outcome.stopped or '-'}, drained {outcome.drained or '-'}, "
                                 f"already gone {outcome.gone or '-'}, lost {outcome.lost or '-'}, "
                                 f"started {outcome.started or '-'}", endpoint=f"agent-{node}")
        return outcome

    def _agent_dead(self, agent: ProcRecord) -> bool:
        """Whether the recorded agent has surely exited; an unreachable node is not
        surely dead: it goes through ``stop``, whose 'unknown' keeps it recorded."""
        from .ssh import SshError

        try:
            return not self.launcher.alive(agent)
        except SshError:
            return False


def _copies_held(status: p.StatusReply, name: str) -> list[str]:
    """``MODEL@VERSION`` of each replica the hub lists for endpoint ``name``, marked
    ``(partial)`` or ``(last complete copy)`` where that is so."""
    out = []
    for v in status.versions:
        mine = next((h for h in v.holders if h.name == name), None)
        if mine is None:
            continue
        others = sum(h.complete and h.name != name for h in v.holders)
        note = " (partial)" if not mine.complete else " (last complete copy)" if not others else ""
        out.append(f"{v.model}@{v.version}{note}")
    return out


def run(name: str, state: ClusterState, action, log=print, *, drain_timeout: float | None = None,
        register_timeout: float = REGISTER_TIMEOUT_S, call_timeout: float = CALL_TIMEOUT_S,
        rollback_timeout: float = ROLLBACK_TIMEOUT_S) -> Outcome:
    op = Operator(name, state, log, drain_timeout=drain_timeout, register_timeout=register_timeout,
                  call_timeout=call_timeout, rollback_timeout=rollback_timeout)
    try:
        return action(op)
    finally:
        op.close()
