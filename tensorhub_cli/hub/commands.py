"""Operator commands and the event log: the part of the hub that tells endpoints to act.

``Sync`` and ``Load`` turn into ``Command``s queued for endpoints (delivered by the
service as pushed frames); endpoints answer with ``Report``s, kept with the hub's own
events (ready, expired, unpublished) in a bounded log that ``Status`` returns. Like
the rest of the hub this is pure: a mixin over ``Hub``'s state, time injected.
"""

from __future__ import annotations

from collections import deque

from . import protocol as p

EVENTS_KEPT = 500


class Commands:
    def _init_events(self) -> None:
        self.events: deque[p.Event] = deque(maxlen=EVENTS_KEPT)
        self._event_seq = 0

    def event(self, now: float, kind: str, endpoint: str = "", model: str = "", version: int = 0,
              message: str = "") -> None:
        self._event_seq += 1
        self.events.append(p.Event(seq=self._event_seq, t=round(now - self.started_at, 3), kind=kind,
                                   endpoint=endpoint, model=model, version=version, message=message))

    def sync(self, now: float, op: p.Sync) -> p.Synced:
        from .state import HubFault, Send  # (state imports this mixin: import at call time)

        if (op.role is None) == (op.node is None):
            raise HubFault("malformed", "sync needs exactly one of role or node")
        if op.version is None:
            v = self._latest(op.model)
        else:
            v = self._version(op.model, op.version)
            self._require_ready(v)
        targets = sorted(name for name, ep in self.endpoints.items() if self._alive(now, name) and (
            ep.info.role == op.role if op.role is not None else ep.info.node == op.node))
        if not targets:
            where = f"role {op.role!r}" if op.role is not None else f"node {op.node!r}"
            raise HubFault("not_found", f"no live endpoint with {where}")
        for name in targets:
            self._outbound.append(Send(endpoint=name, body=p.Command(action="fetch", model=v.model, version=v.number)))
        self.event(now, "sync", model=v.model, version=v.number, message=f"{len(targets)} target(s)")
        return p.Synced(version=v.number, targets=targets)

    def load_checkpoint(self, now: float, op: p.Load) -> p.Ok:
        from .state import HubFault, Send

        agent = f"agent-{op.node}"
        if agent not in self.endpoints or not self._alive(now, agent):
            raise HubFault("not_found", f"node {op.node!r} has no live agent")
        if op.version < 1:
            raise HubFault("malformed", f"version must be >= 1, got {op.version}")
        if op.version in self.models.get(op.model, {}):
            raise HubFault("conflict", f"{op.model}@{op.version} exists already")
        self._outbound.append(Send(endpoint=agent, body=p.Command(
            action="load", model=op.model, version=op.version, path=op.path, chunk_bytes=op.chunk_bytes)))
        return p.Ok()

    def note(self, now: float, op: p.Note) -> p.Ok:
        self.event(now, op.kind[:40], op.endpoint[:200], message=op.message[:500])
        return p.Ok()

    def report(self, now: float, op: p.Report) -> p.Ok:
        self._endpoint(op.name)
        self.event(now, op.kind, op.name, op.model, op.version, op.message[:500])
        return p.Ok()
