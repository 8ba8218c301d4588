"""Read-only views of the hub: ``th versions`` and ``th status``. They change nothing."""

from __future__ import annotations

from . import protocol as p
from .faults import HubFault
from .state import HubState


def versions(hub: HubState, now: float, op: p.Versions) -> p.VersionsReply:
    models = [op.model] if op.model else sorted(hub.models)
    if op.model and op.model not in hub.models:
        raise HubFault("not_found", f"model {op.model!r} has no versions")
    return p.VersionsReply(versions=[v.status(hub.reliable) for m in models
                                     for _, v in sorted(hub.models[m].items())])


def status(hub: HubState, now: float) -> p.StatusReply:
    held: dict[str, int] = {}
    for vs in hub.models.values():
        for v in vs.values():
            for name in v.replicas:
                held[name] = held.get(name, 0) + 1
    eps = [
        p.EndpointStatus(name=ep.name, node=ep.info.node, role=ep.info.role, kind=ep.info.kind,
                         alive=hub.alive(now, ep.name), heartbeat_age_s=round(now - ep.last_seen, 3),
                         replicas=held.get(ep.name, 0), rack=ep.info.rack, dc=ep.info.dc,
                         reliable=ep.info.reliable, pid=ep.info.pid, bytes_planned=ep.bytes_planned,
                         bytes_from_publishers=ep.bytes_from_publishers)
        for ep in sorted(hub.endpoints.values(), key=lambda e: e.name)
    ]
    return p.StatusReply(cluster=hub.config.cluster, uptime_s=round(now - hub.started_at, 3), endpoints=eps,
                         versions=versions(hub, now, p.Versions()).versions, counters=dict(hub.counters),
                         events=list(hub.events)[-50:])
