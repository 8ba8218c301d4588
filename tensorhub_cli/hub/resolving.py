"""Resolving a version for a reader (contracts 1 and 2).

Only READY versions resolve; ``latest`` is the highest READY one. A version an operator
is withdrawing whole (``th unpublish``, ``commands.withdraw``) no longer resolves: it is
``not_found`` by number and never ``latest``. A reader that names
a ``group`` resolves ``latest`` inside that group's open round (``groups.Round``), so
every member gets the same version even when a newer one becomes READY mid-round.
The answer carries the version's manifests unless the reader said it holds that very
version (``Resolve.known``: number and manifest digest).
"""

from __future__ import annotations

from . import protocol as p
from .draining import withdrawn_numbers
from .faults import HubFault
from .groups import Round, round_over
from .registry import READY, UNAVAILABLE, Version
from .state import HubState


def resolve(hub: HubState, now: float, op: p.Resolve) -> p.Resolved:
    hub.endpoint(op.name)
    hub.count("resolves")  # (one per engine where its workers share a resolution: Endpoint.resolve)
    versions = hub.models.get(op.model)
    if not versions:
        raise HubFault("not_found", f"model {op.model!r} has no versions")
    if op.version is not None:
        v = hub.version(op.model, op.version)
        if v.number in withdrawn_numbers(hub).get(op.model, ()):
            raise HubFault("not_found", f"{v.model}@{v.number} is being withdrawn (th unpublish)")
        require_ready(v, now < hub.grace_until)
        return _resolved(v, 0, op.known)
    if op.group is None:
        return _resolved(latest(hub, op.model), 0, op.known)
    key = (op.model, op.group)
    rnd = hub.rounds.get(key)
    if rnd is not None:
        members = {n for n, ep in hub.endpoints.items() if ep.info.group == op.group}
        v_round = hub.models[op.model].get(rnd.version)
        why = round_over(rnd, members, now, hub.config.round_timeout_s, lambda n: n in hub.endpoints,
                         lambda n: v_round is not None and v_round.loaded(n), op.name)
        if why is not None or v_round is None:
            hub.count(f"rounds_ended.{(why or 'version dropped').replace(' ', '_')}")
            rnd = None
    if rnd is None:
        newest = latest(hub, op.model)
        number = hub.rounds[key].number + 1 if key in hub.rounds else 1
        rnd = hub.rounds[key] = Round(number=number, version=newest.number, opened_at=now)
    v = hub.models[op.model][rnd.version]
    require_ready(v, now < hub.grace_until)
    rnd.resolved.add(op.name)
    return _resolved(v, rnd.number, op.known)


def latest(hub: HubState, model: str) -> Version:
    gone = withdrawn_numbers(hub).get(model, ())
    ready = [v for v in hub.models.get(model, {}).values() if v.state == READY and v.number not in gone]
    if not ready:
        but = " but those being withdrawn" if gone else ""
        raise HubFault("not_found", f"model {model!r} has no READY version{but}")
    return max(ready, key=lambda v: v.number)


def require_ready(v: Version, rebuilding: bool = False) -> None:
    """``rebuilding``: the hub restarted within its grace period, so a chunk no live
    endpoint holds may be held by one that has not re-registered yet (contract 7):
    ``rebuilding`` is an answer to ask again, not UNAVAILABLE's give up."""
    if v.state == UNAVAILABLE and rebuilding:
        raise HubFault("rebuilding", f"{v.model}@{v.number}: the hub restarted and its holders are still "
                                     "registering again; ask again shortly")
    if v.state == UNAVAILABLE:
        missing = v.missing()
        raise HubFault("unavailable", f"{v.model}@{v.number} is UNAVAILABLE: no live endpoint holds "
                       f"{len(missing)} chunk(s), e.g. {missing[:8]}", missing)
    if v.state != READY:
        raise HubFault("not_ready", f"{v.model}@{v.number} is {v.state}")


def _resolved(v: Version, rnd: int, known: dict[int, int]) -> p.Resolved:
    """The answer; without the manifests when the reader holds this very version (the
    same number and manifest digest: a number published again is another version)."""
    shards = [] if known.get(v.number) == v.digest else v.manifests()
    return p.Resolved(model=v.model, version=v.number, world=v.world, shards=shards, round=rnd)
