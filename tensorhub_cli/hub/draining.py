"""Unpublish, drain and retention (contracts 3 and 4).

``unpublish`` is deferred: it stops routing new reads to the replica at once, and an
``Acked`` is queued only when ``settle`` finds the drain complete: no pins on the
replica; for a replica rebuilt from a re-registration, the restart grace period over
(one the hub saw begin has no reads it does not know of); and, when the replica's
version is retained and would fall short of its policy, a host copy pulled by an
agent first (or no agent left that could make one). ``settle`` also starts the retention pulls now needed, and
``drop_old`` forgets READY versions that fell out of ``keep_latest`` once nobody reads
them, telling agents to discard their copies.

An operator's withdrawal (``th unpublish``, ``commands.withdraw``) drains replicas the
same way, started by the hub: ``settle`` marks each replica it targets draining (also
one that appears later, a reader starting on the version) and sends its holder an
``unpublish`` command so it lets the memory go; the replica goes once its pins are
zero and, being filled by a reader, once that reader's own reads ended. A withdrawn
version (no ``node``) is left out of retention; a node's withdrawal takes no copy onto
that node. The operator is answered (``Answered``) once no targeted replica is left,
or, at the deadline, told who still holds it and why.
"""

from __future__ import annotations

from ..planner import Place, leave
from . import protocol as p
from .faults import Acked, Answered, HubFault, Send
from .registry import READY, Version
from .retention import Policy, pulls_needed, retained, short
from .state import HubState, Withdrawal


def unpublish(hub: HubState, now: float, op: p.Unpublish) -> None:
    """Deferred: an ``Acked`` is queued once the replica's pins reach zero (and any
    retention copy it called for is complete)."""
    hub.endpoint(op.name, op.incarnation)
    v = hub.version(op.model, op.version)
    rep = v.replicas.get(op.name)
    if rep is None:
        raise HubFault("not_found", f"{op.name} holds no replica of {op.model}@{op.version}")
    v.draining.add(op.name)  # contract 3: no new reads from here on
    v.respread()
    v.pulls.discard(op.name)  # a retention copy it was making is abandoned with it
    hub.count("unpublishes")
    settle(hub, now, v)
    return None


def forget_replica(v: Version, name: str, place: Place | None) -> None:
    """``name``'s replica of ``v`` is gone: so is it from every index over replicas."""
    del v.replicas[name]
    v.publishers.discard(name)
    for tiles in v.layouts.values():
        tiles.pop(name, None)
    v.respread()
    v.holding.drop(name)
    if place is not None:
        leave(v.near, place, name)


def settle(hub: HubState, now: float, only: Version | None = None) -> None:
    """Start the retention pulls now needed; acknowledge every drain now complete.

    ``only``: the one version an operation touched (the hot path: progress). When a
    drain empties a version and it is forgotten, an older version may move up into
    keep_latest, and its drains must then wait for copies. So versions are judged
    newest first, and a model that lost one is judged again from the top before any
    older version of it is acknowledged. (Terminates: each extra pass follows a
    version being dropped.)"""
    marked = _mark_withdrawn(hub) if hub.withdrawals else []
    todo = [only] if only else [v for vs in hub.models.values() for v in vs.values()]
    todo += [v for v in marked if only is not None and v is not only]
    while todo:
        moved = _settle_pass(hub, now, todo)
        todo = [v for m in sorted(moved) for v in hub.models.get(m, {}).values()]
    if hub.withdrawals:
        _judge_withdrawals(hub, now)


def _settle_pass(hub: HubState, now: float, todo: list[Version]) -> set[str]:
    todo = sorted(todo, key=lambda v: (v.model, -v.number))
    keeps: dict[str, set[int]] = {}
    withdrawn = withdrawn_numbers(hub)
    moved: set[str] = set()  # models that lost a version in this pass
    for v in todo:
        versions = hub.models[v.model]
        if v.number not in versions or v.model in moved:
            continue  # its older versions: judged in the next pass, with the new keep set
        policy = hub.policy(v.model)
        if v.model not in keeps:
            keeps[v.model] = set(retained(versions, policy, withdrawn.get(v.model, ())))
        kept = v.number in keeps[v.model]
        if kept:
            _start_pulls(hub, now, v, policy)
        for name in sorted(v.draining):
            if _drained(hub, now, v, name, kept, policy):
                v.draining.discard(name)
                forget_replica(v, name, hub.endpoints[name].place)
                hub.queue(Acked(endpoint=name, model=v.model, version=v.number))
                hub.count("unpublish_acks")
                hub.event(now, "unpublished", name, v.model, v.number)
                if not v.replicas:  # its holders let it go: forget it
                    del versions[v.number]
                    hub.count("versions_dropped")
                    moved.add(v.model)
                    break
        else:
            v.refresh()
    return moved


def _drained(hub: HubState, now: float, v: Version, name: str, is_retained: bool, policy: Policy) -> bool:
    if v.pins.get(name, 0) or now < hub.grace_until and _restored(v, name):
        return False
    if v.feeds.get(name) and _withdrawing(hub, v, name):
        # A reader the hub drains did not cancel first, as an unpublishing endpoint does:
        # forgotten now, its reads would pin their sources with no replica left to show.
        return False
    if not is_retained or v.state != READY or not short(v, policy, hub.reliable):
        return True  # (not READY: no complete copy can be made, so none is waited for)
    # Short: wait for a pull under way; give up only when no agent can make a copy.
    pulling = any(hub.alive(now, a) and not v.complete(a) for a in v.pulls)
    return not pulling and not _pull_candidates(hub, now, v)


def _restored(v: Version, name: str) -> bool:
    rep = v.replicas.get(name)
    return rep is None or rep.restored


def _pull_candidates(hub: HubState, now: float, v: Version) -> list[str]:
    off = {w.node for w in hub.withdrawals.values() if w.version is v and w.node}  # copies are taken away from there
    agents = [ep for ep in hub.endpoints.values()
              # an agent letting its own replica go cannot be the one to keep a copy
              if ep.info.kind == "agent" and hub.alive(now, ep.name) and ep.name not in v.pulls
              and ep.name not in v.draining and not v.complete(ep.name) and ep.info.node not in off]
    agents.sort(key=lambda ep: (not ep.info.reliable, hub.load.get(ep.name, 0), ep.name))
    return [ep.name for ep in agents]


def _start_pulls(hub: HubState, now: float, v: Version, policy: Policy) -> None:
    if v.state != READY:
        return  # nothing complete to copy from
    need = pulls_needed(v, policy, hub.reliable)
    for agent in _pull_candidates(hub, now, v)[:need]:
        v.pulls.add(agent)
        hub.queue(Send(endpoint=agent, body=p.Command(action="retain", model=v.model, version=v.number)))
        hub.count("retention_pulls")


def drop_old(hub: HubState, model: str) -> None:
    """Once READY versions fall out of keep_latest, forget those nobody is reading."""
    versions = hub.models[model]
    keep = set(retained(versions, hub.policy(model), withdrawn_numbers(hub).get(model, ())))
    in_rounds = {r.version for (m, _), r in hub.rounds.items() if m == model}
    newest = max(keep) if keep else 0
    for number in [n for n, v in versions.items() if v.ever_ready and n not in keep and n < newest]:
        v = versions[number]
        if not v.pins and number not in in_rounds and not v.draining:
            del versions[number]
            hub.count("versions_dropped")
            # Agents hold retention copies nobody will unpublish: tell them to let go,
            # or every version ever retained would stay in their host memory.
            for name in sorted(v.replicas):
                ep = hub.endpoints.get(name)
                if ep is not None and ep.info.kind == "agent":
                    hub.queue(Send(endpoint=name, body=p.Command(action="discard", model=model, version=number)))


# --- operators' withdrawals (th unpublish) --------------------------------------------


def _current(hub: HubState, w: Withdrawal) -> bool:
    """The withdrawn version is still the one the hub knows under its number."""
    return hub.models.get(w.version.model, {}).get(w.version.number) is w.version


def withdrawn_numbers(hub: HubState) -> dict[str, set[int]]:
    """Per model, the versions withdrawn whole: retention leaves them out."""
    out: dict[str, set[int]] = {}
    for w in hub.withdrawals.values():
        if not w.node and _current(hub, w):
            out.setdefault(w.version.model, set()).add(w.version.number)
    return out


def _withdrawing(hub: HubState, v: Version, name: str) -> bool:
    return any(w.version is v and w.targets(name, hub.endpoints) for w in hub.withdrawals.values())


def _mark_withdrawn(hub: HubState) -> list[Version]:
    """Drain every targeted replica not draining yet (contract 3: no new reads from it)
    and tell its holder to unpublish; returns the versions touched."""
    touched = []
    for w in hub.withdrawals.values():
        v = w.version
        if not _current(hub, w):
            continue
        fresh = [n for n in sorted(v.replicas) if n not in v.draining and w.targets(n, hub.endpoints)]
        for name in fresh:
            v.draining.add(name)
            v.pulls.discard(name)  # a retention copy it was making is abandoned with it
            hub.queue(Send(endpoint=name, body=p.Command(action="unpublish", model=v.model, version=v.number)))
            hub.count("withdraw_unpublishes")
        w.seen.update(n for n in v.replicas if w.targets(n, hub.endpoints))
        if fresh:
            v.respread()
            touched.append(v)
    return touched


def _judge_withdrawals(hub: HubState, now: float) -> None:
    """Answer each withdrawal whose replicas are all gone; tell the operator who still
    holds one once its deadline passed (the drains go on: the record stays until done)."""
    for key, w in list(hub.withdrawals.items()):
        v = w.version
        current = _current(hub, w)
        left = sorted(n for n in v.replicas if w.targets(n, hub.endpoints)) if current else []
        if not left:
            if current and not w.node:  # no holder left (an UNAVAILABLE version had none): forget it
                del hub.models[v.model][v.number]
                hub.count("versions_dropped")
            del hub.withdrawals[key]
            if not w.answered:
                hub.queue(Answered(key=key, body=p.Withdrawn(model=v.model, version=v.number,
                                                             endpoints=sorted(w.seen))))
            hub.event(now, "withdrawn", model=v.model, version=v.number, message=_where(w))
        elif now >= w.deadline and not w.answered:
            w.answered = True
            why = "; ".join(f"{n} ({_holding_why(hub, now, v, n)})" for n in left)
            hub.queue(Answered(key=key, body=p.Error(code="timeout", message=(
                f"{v.model}@{v.number}{_where(w, ' on node ')} is still held after {w.timeout_s:g}s by "
                f"{why}; its drains go on"))))
            hub.event(now, "withdraw_timeout", model=v.model, version=v.number, message=why[:500])


def _where(w: Withdrawal, prefix: str = "node ") -> str:
    return f"{prefix}{w.node}" if w.node else ""


def _holding_why(hub: HubState, now: float, v: Version, name: str) -> str:
    if v.pins.get(name):
        return f"{v.pins[name]} read(s) from it in flight"
    if v.feeds.get(name):
        return f"{v.reading(name).bit_count()} read(s) of its own in flight"
    if now < hub.grace_until and _restored(v, name):
        return "the hub restarted: waiting for every reader to register again"
    if v.pulls:
        return f"waiting for a retention copy by {', '.join(sorted(v.pulls))}"
    return "draining"
