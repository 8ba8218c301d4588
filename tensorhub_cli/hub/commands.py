"""Operator commands: the part of the hub that tells endpoints to act.

``Sync`` and ``Load`` turn into ``Command``s queued for endpoints (``Send``, delivered
by the service as pushed frames); endpoints answer with ``Report``s, which join the
hub's own events (ready, expired, unpublished) in the bounded log ``Status`` returns.
``Note`` records an operator event (scaled, failed over).
"""

from __future__ import annotations

from . import protocol as p
from .faults import HubFault, Send
from .resolving import latest, require_ready
from .state import HubState


def sync(hub: HubState, now: float, op: p.Sync) -> p.Synced:
    if (op.role is None) == (op.node is None):
        raise HubFault("malformed", "sync needs exactly one of role or node")
    if op.version is None:
        v = latest(hub, op.model)
    else:
        v = hub.version(op.model, op.version)
        require_ready(v)
    targets = sorted(name for name, ep in hub.endpoints.items() if hub.alive(now, name) and (
        ep.info.role == op.role if op.role is not None else ep.info.node == op.node))
    if not targets:
        where = f"role {op.role!r}" if op.role is not None else f"node {op.node!r}"
        raise HubFault("not_found", f"no live endpoint with {where}")
    for name in targets:
        hub.queue(Send(endpoint=name, body=p.Command(action="fetch", model=v.model, version=v.number)))
    hub.event(now, "sync", model=v.model, version=v.number, message=f"{len(targets)} target(s)")
    return p.Synced(version=v.number, targets=targets)


def load_checkpoint(hub: HubState, now: float, op: p.Load) -> p.Ok:
    agent = f"agent-{op.node}"
    if agent not in hub.endpoints or not hub.alive(now, agent):
        raise HubFault("not_found", f"node {op.node!r} has no live agent")
    if op.version < 1:
        raise HubFault("malformed", f"version must be >= 1, got {op.version}")
    if op.version in hub.models.get(op.model, {}):
        raise HubFault("conflict", f"{op.model}@{op.version} exists already")
    hub.queue(Send(endpoint=agent, body=p.Command(
        action="load", model=op.model, version=op.version, path=op.path, chunk_bytes=op.chunk_bytes)))
    return p.Ok()


def events_since(hub: HubState, now: float, op: p.Events) -> p.EventsReply:
    """Events after ``op.since``; ``first_seq`` says whether the bound dropped some."""
    kept = hub.events
    first, last = (kept[0].seq, kept[-1].seq) if kept else (0, 0)
    return p.EventsReply(events=[e for e in kept if e.seq > op.since], first_seq=first, last_seq=last)


def note(hub: HubState, now: float, op: p.Note) -> p.Ok:
    hub.event(now, op.kind[:40], op.endpoint[:200], message=op.message[:500])
    return p.Ok()


def report(hub: HubState, now: float, op: p.Report) -> p.Ok:
    hub.endpoint(op.name)
    hub.event(now, op.kind, op.name, op.model, op.version, op.message[:500])
    return p.Ok()
