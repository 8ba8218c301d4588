"""Endpoints joining, staying and leaving (contracts 6 and 7).

- ``register``: an endpoint joins, or re-joins after a hub restart carrying its
  holdings (replicas, reads in flight), from which the registry is rebuilt. A second
  live process under a name is refused; a restarted one (new pid) replaces the old.
  The same incarnation registering again (its heartbeat reply was slow, so it was
  unsure the hub still knew it) keeps everything: pins, reads, a pending unpublish.
- ``heartbeat``: keeps it alive, and so does a plan as it arrives (``heard``); a
  reader's beat also tells how far its fetches are (``Heartbeat.filling``), which
  operators see; its reports alone make it a holder of chunks;
  ``expire(now)`` drops every endpoint silent for longer than ``expiry_s``.
- ``excuse``: silence is counted only while the hub listens. When the hub's own
  process heard nothing for a while (descheduled, paused), the beats sent meanwhile are
  still queued, so that time is taken off every endpoint's silence.
- ``drop_endpoint``: a gone endpoint loses every reference, pin and read it had; a
  pending unpublish of its is answered not-ok; every live reader with reads scheduled
  from it is told to ``replan`` that version now, not when its own read or wait times
  out (a link that went down fails nothing on its own for the read timeout, 30 s).
"""

from __future__ import annotations

from ..planner import join, leave
from . import protocol as p
from .draining import forget_replica, settle
from .faults import Acked, HubFault, Send
from .publishing import note_seed, restore
from .state import Endpoint, HubState


def register(hub: HubState, now: float, op: p.Register) -> p.Ok:
    old = hub.endpoints.get(op.info.name)
    if old is not None and op.info.incarnation and old.info.incarnation == op.info.incarnation:
        old.last_seen = now  # contract 3: a slow beat never releases a pin early
        hub.count("registrations.kept")
        return p.Ok()
    if old is not None and old.info.pid != op.info.pid and hub.alive(now, old.name):
        # Two live processes under one name would corrupt every reference it owns.
        raise HubFault("conflict", f"endpoint name {op.info.name!r} is held by a live endpoint (pid {old.info.pid})")
    if old is not None:
        drop_endpoint(hub, now, old.name)
    ep = hub.endpoints[op.info.name] = Endpoint(info=op.info, last_seen=now)
    join(hub.near, ep.place, ep.name)
    hub.count("registrations")
    for holding in op.holdings:
        try:
            restore(hub, now, op.info.name, holding)
        except HubFault:
            hub.count("errors.holding")  # one stale holding must not cost the others
    for v, reader, chunk in hub.unplaced.pop(op.info.name, []):
        if reader in hub.endpoints and op.info.name in v.feeds.get(reader, ()):
            note_seed(hub, v, reader, op.info.name, chunk)
    settle(hub, now)
    return p.Ok()


def heartbeat(hub: HubState, now: float, op: p.Heartbeat) -> p.Ok:
    hub.endpoint(op.name, op.incarnation).last_seen = now
    for f in op.filling:  # (display only: a version or replica gone meanwhile is no error)
        v = hub.models.get(f.model, {}).get(f.version)
        rep = v.replicas.get(op.name) if v is not None else None
        if rep is not None and rep.rank < 0:
            rep.told = int.from_bytes(f.held, "little") & v.full
    return p.Ok()


def heard(hub: HubState, now: float, name: str, incarnation: str) -> None:
    """A plan from ``name`` arrived at ``now``: it was alive then, as a heartbeat would
    say (its service thread skips the beat due within a period of an answered plan).
    Taken on arrival, not when the plan is served: a plan that queued behind others says
    nothing of later. Nothing for an unknown endpoint or another incarnation: the plan
    itself is refused."""
    ep = hub.endpoints.get(name)
    if ep is not None and (not incarnation or not ep.info.incarnation or incarnation == ep.info.incarnation):
        ep.last_seen = max(ep.last_seen, now)


def deregister(hub: HubState, now: float, op: p.Deregister) -> p.Ok:
    hub.endpoint(op.name, op.incarnation)
    drop_endpoint(hub, now, op.name)
    settle(hub, now)
    return p.Ok()


def excuse(hub: HubState, now: float, seconds: float) -> None:
    """The hub heard nothing for ``seconds`` before ``now``: nobody's silence grows by
    them (and nobody is seen later than ``now``)."""
    for ep in hub.endpoints.values():
        ep.last_seen = min(now, ep.last_seen + seconds)
    hub.count("stalls")
    hub.event(now, "stalled", message=f"the hub heard nothing for {seconds:.2f} s; excused from every silence")


def expire(hub: HubState, now: float) -> list[str]:
    dead = [n for n in hub.endpoints if not hub.alive(now, n)]
    for name in dead:
        drop_endpoint(hub, now, name)
        hub.count("expiries")
        hub.event(now, "expired", name)
    if dead:
        settle(hub, now)
    return dead


def drop_endpoint(hub: HubState, now: float, name: str) -> None:
    """Contract 6: a gone endpoint loses every reference, pin and read it had."""
    ep = hub.endpoints.pop(name, None)
    hub.asking.forget(name)
    if ep is not None:
        leave(hub.near, ep.place, name)
    for versions in hub.models.values():
        for v in versions.values():
            hub.unpin(v, name, -1)
            for reader in [r for r, feeds in v.feeds.items() if name in feeds]:
                hub.unpin(v, reader, v.feeds[reader][name])
                if reader in hub.endpoints:
                    hub.queue(Send(endpoint=reader, body=p.Command(action="replan", model=v.model,
                                                                  version=v.number)))
            if name in v.replicas:
                forget_replica(v, name, ep.place if ep is not None else None)
            if name in v.draining:
                v.draining.discard(name)
                hub.queue(Acked(endpoint=name, model=v.model, version=v.number, ok=False))
            v.pulls.discard(name)
            v.avoid.pop(name, None)
            for dc in [dc for dc, seed in v.seeds.items() if seed == name]:
                del v.seeds[dc]
            v.refresh()
        for number in [n for n, v in versions.items() if not v.replicas and not v.ever_ready]:
            del versions[number]  # a STAGING version whose publishers are all gone
