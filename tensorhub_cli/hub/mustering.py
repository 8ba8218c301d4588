"""Musters: the first readers of a new swarm, laid out together, nearest the roots first.

Why. A chain member has one free slot, its tail, so a swarm's chains follow the order
its members' plans arrive in; readers that start together arrive in any order, and a
chain that runs back and forth between racks puts several of its links on one rack
uplink (the 8-node testbed's N = 7 took 3.02 s or 3.76 s with its arrival order; the
simulator, 2.70 s with the chain sorted by rack against 3.70 s interleaved).

Protocol. A reader's first scheduled plan of a version, for a swarm (DC, want) that
has no members yet, is not answered at once: ``reading.plan`` parks it here (it
returns None; the service holds the reply under ``key(op)``) and the swarm's muster
opens for ``HubConfig.muster_s``. Every first plan for that swarm within it is parked
too. ``close(now)`` (the service calls it at ``due()``) runs the parked plans in the
muster's order and queues each answer as an ``Answered`` for its key: the readers
join the swarm sorted by where they sit (racks of the swarm's publishers first, then
by rack and node), dealt so that each chain gets a run of neighbours. Readers joining
after the muster closed go behind a chain's tail, as before. Nothing else waits: a
reader's later plans, windowed plans and the star planner are answered at once.

A parked plan holds no pin, no read and no replica (an unpublish meanwhile has
nothing of it to drain); a parked reader that expires meanwhile is answered with the
refusal its plan then gets (``unknown_endpoint``). Musters are soft state: a
restarted hub has none, and a parked reader's request times out and asks again.
``muster_s`` 0 (the state machine's default: tests, the replay) answers every plan
at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import protocol as p
from .defaults import MUSTER_S  # noqa: F401 (the default ``muster_s``, named here too)
from .faults import Answered, HubFault
from .registry import Version
from .scheduling import heads, publishers_of
from .state import HubState


@dataclass
class Muster:
    deadline: float
    plans: dict[str, p.Plan] = field(default_factory=dict)  # reader -> its parked first plan


def key(op: p.Plan) -> tuple:
    """The service's waiter key of a parked plan."""
    return ("plan", op.name, op.model, op.version)


def park(hub: HubState, now: float, v: Version, op: p.Plan, dc: str, want: int) -> bool:
    """Park ``op`` (a reader's first scheduled plan) if its swarm is still mustering or
    has yet to form; False: answer it now."""
    if hub.config.muster_s <= 0 or hub.config.planner == "star":
        return False
    swarm = (dc, want)
    if swarm in v.swarms.by_key or swarm in v.mustered:
        return False
    muster = hub.musters.get((v.model, v.number, *swarm))
    if muster is None:
        muster = hub.musters[(v.model, v.number, *swarm)] = Muster(now + hub.config.muster_s)
    muster.plans[op.name] = op  # (a retried first plan replaces the one parked)
    return True


def due(hub: HubState) -> float | None:
    """When the next muster closes (None: none is open)."""
    return min((m.deadline for m in hub.musters.values()), default=None)


def close(hub: HubState, now: float, plan) -> None:
    """Answer every muster due by ``now``: its plans run through ``plan(hub, now, op)``
    in the muster's order, each answer queued as ``Answered(key(op), body)``."""
    for mkey in [k for k, m in hub.musters.items() if m.deadline <= now]:
        muster = hub.musters.pop(mkey)
        model, number, dc, want = mkey
        v = hub.models.get(model, {}).get(number)
        if v is not None:
            v.mustered.add((dc, want))
        ranked = order(hub, v, dc, want, list(muster.plans.values()))
        hub.count("musters")
        hub.count("mustered_plans", len(ranked))
        hub.event(now, "muster", model=model, version=number,
                  message=f"{dc}: {len(ranked)} reader(s) joined in order: {' '.join(op.name for op in ranked)}"[:500])
        for op in ranked:
            try:
                body = plan(hub, now, op)
            except HubFault as fault:
                body = fault.as_error()
            hub.queue(Answered(key(op), body))


def order(hub: HubState, v: Version | None, dc: str, want: int, plans: list[p.Plan]) -> list[p.Plan]:
    """Nearest the roots first (the racks of the want's publishers in ``dc``), then by
    rack and node; with C chains (``scheduling.heads``), dealt so that member j of the
    join order, which goes to chain j mod C, makes chain c the c-th run of the sorted
    readers: each chain crosses between racks as few times as the sort allows."""
    roots = {where.place.rack for _, where in publishers_of(hub, v, want)
             if where is not None and where.place.dc == dc} if v is not None else set()

    def place(op: p.Plan) -> tuple:
        ep = hub.endpoints.get(op.name)
        if ep is None:
            return (True, "", "", op.name)
        return (ep.place.rack not in roots, ep.place.rack, ep.place.node, op.name)

    ranked = sorted(plans, key=place)
    n = len(ranked)
    chains = min(max(1, heads(hub, v, dc, want)) if v is not None else 1, max(1, n))
    # (the longer runs first: then only the last round of the deal is short, and the
    # j-th member of run c is the (j * chains + c)-th to join, chain c's j-th)
    runs, at = [], 0
    for c in range(chains):
        size = n // chains + (c < n % chains)
        runs.append(ranked[at:at + size])
        at += size
    return [run[j] for j in range(len(runs[0]) if runs else 0) for run in runs if j < len(run)]
