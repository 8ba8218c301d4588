"""Operator actions on a running cluster: ``th publish --from`` and ``th sync``.

Both ask the hub to command endpoints (``Load`` → the node's agent, ``Sync`` → the
targets), then watch the hub's view until every target is done or has failed: a
complete replica is success; a ``*_failed`` report, or a target the hub no longer
lists as alive, is failure. Nothing here moves bytes. Every wait has a deadline the
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
    except HubError as exc:
        raise OperateError(str(exc), 2 if exc.code in ("not_found", "conflict", "malformed") else 1) from None
    except HubUnreachable as exc:
        raise OperateError(str(exc)) from None


def _last_seq(client: HubClient, timeout: float) -> int:
    events = _call(client, p.Status(), timeout).events
    return events[-1].seq if events else 0


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
            raise OperateError(str(exc)) from None
        return 1
    except HubUnreachable as exc:
        raise OperateError(str(exc)) from None
    return max((v.version for v in versions), default=0) + 1


def publish_file(client: HubClient, node: str, model: str, path: str, version: int, chunk_bytes: int,
                 timeout: float, call_timeout: float = CALL_TIMEOUT_S, poll_s: float = POLL_S) -> p.VersionStatus:
    """Have ``node``'s agent load ``path`` and publish it; returns the READY version,
    or fails once ``timeout`` seconds have passed."""
    since = _last_seq(client, call_timeout)
    _call(client, p.Load(node=node, model=model, version=version, path=path, chunk_bytes=chunk_bytes), call_timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = _call(client, p.Status(), call_timeout)
        for e in status.events:
            if e.seq > since and e.kind == "load_failed" and (e.model, e.version) == (model, version):
                raise OperateError(f"agent-{node} could not publish {path}: {e.message}")
        for v in status.versions:
            if (v.model, v.version) == (model, version) and v.state == "READY":
                return v
        time.sleep(poll_s)
    raise OperateError(f"{model}@{version} was not READY within {timeout:.0f}s (see `th logs {node}`)")


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
         call_timeout: float = CALL_TIMEOUT_S, poll_s: float = POLL_S) -> SyncRun:
    """Ask for the sync and watch it; a target not done within ``timeout`` seconds is
    marked failed."""
    since = _last_seq(client, call_timeout)
    synced = _call(client, p.Sync(model=model, version=version, role=role, node=node), call_timeout)
    run = SyncRun(model=model, version=synced.version, nbytes=0,
                  targets={n: Target(n) for n in synced.targets})
    deadline = time.monotonic() + timeout
    while not run.finished:
        status = _call(client, p.Status(), call_timeout)
        alive = {e.name for e in status.endpoints if e.alive}
        vs = next((v for v in status.versions if (v.model, v.version) == (model, run.version)), None)
        holders = {h.name: h for h in vs.holders} if vs else {}
        run.nbytes = vs.nbytes if vs else run.nbytes
        failures = {e.endpoint: e.message for e in status.events
                    if e.seq > since and e.kind.endswith("_failed") and (e.model, e.version) == (model, run.version)}
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
