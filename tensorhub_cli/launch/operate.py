"""Operator actions on a running cluster: ``th publish --from`` and ``th sync``.

Both ask the hub to command endpoints (``Load`` → the node's agent, ``Sync`` → the
targets), then watch the hub's view until every target is done or has failed: a
complete replica is success; a ``*_failed`` report, or a target the hub no longer
lists as alive, is failure. Nothing here moves bytes. A sync with no live target is
bad input (exit 2) that names the role or node and the command that would make one
(``th scale ROLE=N``; ``--role agent`` syncs every node's agent). Messages carry the
hub's words, never its protocol codes.

Reports are followed with the hub's ``Events`` op from the seq current when the
command started, so every event since then is seen, however many others came in
between (a status shows only the last few). When the hub's bound dropped some
(``first_seq > since + 1``) the command says so and goes on judging by holders and
liveness, which cannot tell a failed target from a slow one before the deadline. Every wait has a deadline the
caller passes: ``timeout`` for the whole operation, ``call_timeout`` for each request
to the hub, ``poll_s`` between looks at its view.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable

POLL_S = 0.2  # default pause between two status requests while watching
CALL_TIMEOUT_S = 5.0  # default limit of one request to the hub


class OperateError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _call(client: HubClient, op: p.Op, timeout: float):
    try:
        return client.call(op, timeout=timeout)
    except HubError as exc:  # the hub's words, without its protocol code (``not_found: ``)
        raise OperateError(exc.error.message, 2 if exc.code in ("not_found", "conflict", "malformed") else 1) from None
    except HubUnreachable as exc:
        raise OperateError(str(exc)) from None


def _last_seq(client: HubClient, timeout: float) -> int:
    # ``Events`` past the end: no events, only the newest seq (a Status would carry
    # every endpoint and version to say the same)
    return _call(client, p.Events(since=1 << 62), timeout).last_seq


class Events:
    """Every hub event after ``since``, in order, each handed out once by ``poll``;
    ``log`` hears once if some were dropped by the hub's bound before we saw them."""

    def __init__(self, client: HubClient, since: int, call_timeout: float, log: Callable[[str], None]):
        self.client, self.since, self.call_timeout, self.log = client, since, call_timeout, log
        self.dropped = False

    def poll(self) -> list[p.Event]:
        reply = _call(self.client, p.Events(since=self.since), self.call_timeout)
        if reply.last_seq < self.since:  # the hub restarted: its seqs began again at 1
            self.log("the hub restarted (its events restart at seq 1); following them from there")
            self.since = 0
            reply = _call(self.client, p.Events(since=0), self.call_timeout)
        if reply.events and reply.first_seq > self.since + 1 and not self.dropped:
            self.dropped = True
            lost = reply.first_seq - self.since - 1
            self.log(f"{lost} hub event(s) (seq {self.since + 1}..{reply.first_seq - 1}) were dropped before they "
                     "could be read "
                     "(the hub keeps a bounded log); a failure reported among them is unknown: judging by holders "
                     "and liveness until the deadline")
        if reply.events:
            self.since = reply.events[-1].seq
        return reply.events


def check_checkpoint(path: Path) -> None:
    """Fail early, naming the file, when a local checkpoint is not a readable safetensors."""
    if not path.is_file():
        raise OperateError(f"--from {path}: no such file", 2)
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if not list(f.keys()):
                raise OperateError(f"--from {path}: holds no tensors", 2)
    except OperateError:
        raise
    except Exception as exc:
        raise OperateError(f"--from {path}: not a safetensors file ({exc})", 2) from None


def next_version(client: HubClient, model: str, call_timeout: float = CALL_TIMEOUT_S) -> int:
    try:
        versions = client.call(p.Versions(model=model), timeout=call_timeout).versions
    except HubError as exc:
        if exc.code != "not_found":
            raise OperateError(exc.error.message) from None
        return 1
    except HubUnreachable as exc:
        raise OperateError(str(exc)) from None
    return max((v.version for v in versions), default=0) + 1


def publish_file(client: HubClient, node: str, model: str, path: str, version: int, chunk_bytes: int,
                 timeout: float, call_timeout: float = CALL_TIMEOUT_S, poll_s: float = POLL_S,
                 log: Callable[[str], None] = lambda line: None) -> p.VersionStatus:
    """Have ``node``'s agent load ``path`` and publish it; returns the READY version,
    or fails once ``timeout`` seconds have passed."""
    events = Events(client, _last_seq(client, call_timeout), call_timeout, log)
    _call(client, p.Load(node=node, model=model, version=version, path=path, chunk_bytes=chunk_bytes), call_timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in events.poll():
            if e.kind == "load_failed" and (e.model, e.version) == (model, version):
                raise OperateError(f"agent-{node} could not publish {path}: {e.message}")
        status = _call(client, p.Status(), call_timeout)
        for v in status.versions:
            if (v.model, v.version) == (model, version) and v.state == "READY":
                return v
        time.sleep(poll_s)
    raise OperateError(f"{model}@{version} was not READY within {timeout:.0f}s (see `th logs {node}`)")


def _sync_targets(client: HubClient, op: p.Sync, call_timeout: float) -> p.Synced:
    """The hub's ``Sync``; no live target is bad input that says what would make one."""
    try:
        return client.call(op, timeout=call_timeout)
    except HubError as exc:
        if exc.code == "not_found" and exc.error.message.startswith("no live endpoint"):
            if op.role is not None:
                hint = ("every node's agent is one: see `th status`, `th up SPEC` restarts dead ones"
                        if op.role == "agent" else f"start some with `th scale {op.role}=N`, or sync "
                        "`--role agent` (every node's agent, into host memory)")
                raise OperateError(f"no live endpoint has role {op.role!r}: {hint}", 2) from None
            raise OperateError(f"no live endpoint on node {op.node!r} (is its agent up? `th status`)", 2) from None
        raise OperateError(exc.error.message, 2 if exc.code in ("not_found", "conflict", "malformed") else 1) from None
    except HubUnreachable as exc:
        raise OperateError(str(exc)) from None


@dataclass
class Target:
    name: str
    held_bytes: int = 0
    done: bool = False
    failed: Optional[str] = None


@dataclass
class SyncRun:
    model: str
    version: int
    nbytes: int
    targets: dict[str, Target] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(t.done or t.failed for t in self.targets.values())


def sync(client: HubClient, model: str, version: Optional[int], role: Optional[str], node: Optional[str],
         timeout: float, on_update: Callable[[SyncRun], None] = lambda run: None,
         call_timeout: float = CALL_TIMEOUT_S, poll_s: float = POLL_S,
         log: Callable[[str], None] = lambda line: None) -> SyncRun:
    """Ask for the sync and watch it; a target not done within ``timeout`` seconds is
    marked failed. ``log`` hears about events the hub dropped before we read them."""
    events = Events(client, _last_seq(client, call_timeout), call_timeout, log)
    failures: dict[str, str] = {}
    synced = _sync_targets(client, p.Sync(model=model, version=version, role=role, node=node), call_timeout)
    run = SyncRun(model=model, version=synced.version, nbytes=0,
                  targets={n: Target(n) for n in synced.targets})
    deadline = time.monotonic() + timeout
    while not run.finished:
        for e in events.poll():
            if e.kind.endswith("_failed") and (e.model, e.version) == (model, run.version):
                failures.setdefault(e.endpoint, e.message)
        status = _call(client, p.Status(), call_timeout)
        alive = {e.name for e in status.endpoints if e.alive}
        vs = next((v for v in status.versions if (v.model, v.version) == (model, run.version)), None)
        holders = {h.name: h for h in vs.holders} if vs else {}
        run.nbytes = vs.nbytes if vs else run.nbytes
        for t in run.targets.values():
            h = holders.get(t.name)
            t.held_bytes = h.held_bytes if h else t.held_bytes
            t.done = bool(h and h.complete)
            if not t.done and t.failed is None:
                if t.name in failures:
                    t.failed = failures[t.name]
                elif t.name not in alive:
                    t.failed = "endpoint expired or left"
                elif vs is None:
                    t.failed = f"{model}@{run.version} is gone from the hub"
        on_update(run)
        if run.finished:
            break
        if time.monotonic() > deadline:
            for t in run.targets.values():
                if not t.done and not t.failed:
                    t.failed = f"not complete within {timeout:.0f}s"
            break
        time.sleep(poll_s)
    return run
