"""The hub's state machine: pure, no sockets, time injected.

Protocol: every operation is a method ``op(now, msg)`` returning a reply body, or
``None`` for an unpublish, a withdrawal or a plan whose answer is deferred, or raising
``HubFault`` with the state unchanged. ``expire(now)`` and ``settle(now)`` must be
called periodically (the service's sweep), and ``muster(now)`` once ``due()`` has
passed. Deferred acknowledgements (``Acked``: an unpublish; ``Answered``: a
withdrawal, for its ``withdraw_key``, or a plan, for ``mustering.key``) and hub → endpoint
commands (``Send``) are queued; take them with ``take_outbound()`` after each call and
deliver them.

State is soft (contract 7): it can be rebuilt entirely from endpoints re-registering
what they hold and what they are reading. For ``grace_s`` after start no unpublish of
a rebuilt replica is acknowledged, so that every live reader has re-registered its
in-flight reads (its pins) before that drain can be judged complete; a replica the
hub saw begin has none it does not know of.

``Hub`` is the one entry point; each operation lives in the module of its concern:

============  ==========================================================
membership    register, heartbeat, deregister, expire, excuse (contracts 6, 7)
publishing    publish, shard assembly, restore on re-register (1, 7)
resolving     resolve, latest, group rounds (1, 2)
reading       plan (through ``planner``), progress, cancel (5, 6, 8)
mustering     a new swarm's first plans, laid out together (8)
draining      unpublish, drain, retention pulls, dropping old versions (3, 4)
commands      sync, load, withdraw, note, report (operator → endpoints)
views         versions, status
============  ==========================================================
"""

from __future__ import annotations

from . import commands, draining, membership, mustering, publishing, reading, resolving, views
from . import protocol as p
from .faults import Acked, Answered, HubFault, Send
from .state import HubConfig, HubState, withdraw_key

__all__ = ["Acked", "Answered", "Hub", "HubConfig", "HubFault", "Send", "withdraw_key"]


class Hub(HubState):
    # --- endpoints -----------------------------------------------------------------
    def register(self, now: float, op: p.Register) -> p.Ok:
        return membership.register(self, now, op)

    def heartbeat(self, now: float, op: p.Heartbeat) -> p.Ok:
        return membership.heartbeat(self, now, op)

    def heard(self, now: float, name: str, incarnation: str = "") -> None:
        membership.heard(self, now, name, incarnation)

    def deregister(self, now: float, op: p.Deregister) -> p.Ok:
        return membership.deregister(self, now, op)

    def expire(self, now: float) -> list[str]:
        """Drop every endpoint silent past ``expiry_s``; returns their names."""
        return membership.expire(self, now)

    def excuse(self, now: float, seconds: float) -> None:
        """The hub itself heard nothing for ``seconds`` before ``now`` (its process
        stalled): that silence is not the endpoints'. Call it before the next op or
        expiry judges anyone alive."""
        membership.excuse(self, now, seconds)

    # --- versions ------------------------------------------------------------------
    def publish(self, now: float, op: p.Publish) -> p.Ok:
        return publishing.publish(self, now, op)

    def resolve(self, now: float, op: p.Resolve) -> p.Resolved:
        return resolving.resolve(self, now, op)

    def unpublish(self, now: float, op: p.Unpublish) -> None:
        """Deferred: an ``Acked`` is queued once the drain (and retention) completes."""
        return draining.unpublish(self, now, op)

    def settle(self, now: float) -> None:
        """Re-judge every drain and retention; some of it turns on time alone (the
        grace period, agents expiring)."""
        draining.settle(self, now)

    # --- reads ---------------------------------------------------------------------
    def plan(self, now: float, op: p.Plan) -> p.Planned | None:
        """None: parked in its swarm's muster, answered by ``muster`` as an ``Answered``."""
        return reading.plan(self, now, op)

    def due(self) -> float | None:
        """When ``muster`` has plans to answer next (None: no muster is open)."""
        return mustering.due(self)

    def muster(self, now: float) -> None:
        """Answer the musters due by ``now`` (``Answered`` for each parked plan)."""
        mustering.close(self, now, reading.plan)

    def progress(self, now: float, op: p.Progress) -> p.Ok:
        return reading.progress(self, now, op)

    def cancel(self, now: float, op: p.Cancel) -> p.Ok:
        return reading.cancel(self, now, op)

    # --- operator commands and views -----------------------------------------------
    def sync(self, now: float, op: p.Sync) -> p.Synced:
        return commands.sync(self, now, op)

    def load_checkpoint(self, now: float, op: p.Load) -> p.Ok:
        return commands.load_checkpoint(self, now, op)

    def withdraw(self, now: float, op: p.Withdraw) -> None:
        """Deferred: an ``Answered`` is queued once the targeted replicas are gone, or at the deadline."""
        return commands.withdraw(self, now, op)

    def events_since(self, now: float, op: p.Events) -> p.EventsReply:
        return commands.events_since(self, now, op)

    def note(self, now: float, op: p.Note) -> p.Ok:
        return commands.note(self, now, op)

    def report(self, now: float, op: p.Report) -> p.Ok:
        return commands.report(self, now, op)

    def versions(self, now: float, op: p.Versions) -> p.VersionsReply:
        return views.versions(self, now, op)

    def status(self, now: float) -> p.StatusReply:
        return views.status(self, now)
