"""Hub commands on an endpoint: the hook, and the handler an endpoint has by default.

Protocol. The hub pushes ``Command``s: ``fetch`` (``th sync``) and ``unpublish`` (``th
unpublish``) to any endpoint; ``retain``, ``load`` and ``discard`` to agents only. The endpoint's service thread
queues them, and two worker threads call the endpoint's handler,
``handler(ep, cmd)``: one with each ``retain`` and ``discard`` in turn, the other with
each other command in turn (``Endpoint(..., on_command=handler)``; given at
construction because the hub may push a command the moment we register). So a handler
may run on both at once, and must be safe to. In it the handler may:

- call any of ``ep``'s methods but ``close`` (``fetch``, ``publish``, ``unpublish``,
  ``discard``, ``report``): it is one more thread using the endpoint, beside the
  caller's own;
- take as long as it needs: heartbeats go on on the service thread, but the next
  command of its worker waits for this one (a retention pull never waits for a fetch);
- report the outcome with ``ep.report`` (``carry_out`` does it): the hub's event log
  is how ``th sync`` learns it. An exception it raises is logged and dropped.

``SyncCommands`` is the default handler: ``fetch`` into what ``ep.accept_sync`` named
for the model (so a trainer or rollout can take part in ``th sync``), ``discard``
drops the replica without a drain, ``unpublish`` unpublishes it with drain (the hub
already drains it for the operator; this lets the memory go once it is acknowledged;
only a failure is reported, as ``unpublish_failed``), except a shard a runner published
itself: its own code unpublishes that when it would have (the hub then answers that it
is gone, and the memory is the runner's again), and would fail were it dropped here;
the agents' commands are reported failed. The agent installs its own handler (``agent.commands``) on top of it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from ..hub import protocol as p
from .errors import EndpointError

log = logging.getLogger("tensorhub.endpoint")
OUTCOMES = {"retain": "retained", "fetch": "fetched", "load": "loaded"}
# (ep, cmd): ep is the ``Endpoint``, untyped here because the endpoint imports this module
CommandHandler = Callable[[Any, p.Command], None]


def carry_out(ep, cmd: p.Command, act: Callable[[], str], *, timeout: Optional[float] = None) -> None:
    """Run ``act`` (it returns the message of its success) and report the outcome:
    ``retained``/``fetched``/``loaded``, or ``<action>_failed`` with the error.
    ``timeout``: for the report (None: the endpoint's ``call_timeout_s``)."""
    kind = OUTCOMES[cmd.action]
    try:
        message = act()
    except Exception as exc:
        kind, message = f"{cmd.action}_failed", f"{type(exc).__name__}: {exc}"
        log.warning("%s: %s of %s@%s failed: %s", ep.name, cmd.action, cmd.model, cmd.version, message)
    ep.report(cmd, kind, message, timeout=timeout)


class SyncCommands:
    """``fetch`` into accepted memory (else into ``fallback(shards)`` if given), within
    ``fetch_timeout`` seconds (default 600: a whole model over a slow link);
    ``discard`` drops the replica; anything else is reported failed."""

    def __init__(self, *, fallback: Optional[Callable] = None, fetch_timeout: float = 600.0,
                 report_timeout: Optional[float] = None, unpublish_timeout: Optional[float] = None):
        """``unpublish_timeout``: an ``unpublish`` command's drain (None: the endpoint's
        ``drain_timeout_s``)."""
        self.fallback = fallback
        self.fetch_timeout = fetch_timeout
        self.report_timeout = report_timeout
        self.unpublish_timeout = unpublish_timeout

    def __call__(self, ep, cmd: p.Command) -> None:
        if cmd.action == "discard":  # the hub forgot it: no drain to wait for, no report
            ep.discard(cmd.model, cmd.version)
        elif cmd.action == "fetch":
            carry_out(ep, cmd, lambda: self.fetch_into(ep, cmd), timeout=self.report_timeout)
        elif cmd.action == "unpublish":
            self.unpublish(ep, cmd)
        else:
            carry_out(ep, cmd, lambda: self.refuse(ep, cmd), timeout=self.report_timeout)

    def fetch_into(self, ep, cmd: p.Command) -> str:
        into = ep.sync_into.get(cmd.model, self.fallback)
        if into is None:
            raise EndpointError(f"{ep.name} accepts no sync of {cmd.model!r} (no accept_sync)")
        ep.fetch(cmd.model, cmd.version, into=into, timeout=self.fetch_timeout)
        return f"{ep.last_fetch['bytes']} bytes"

    def unpublish(self, ep, cmd: p.Command) -> None:
        """An operator withdrew our replica: unpublish it (with drain). One we no longer
        hold, or a fetch still filling (it fails on the drain and lets go itself), is
        left alone: two threads dropping one registration would free it twice. So is a
        runner's own published shard (see the module's docstring)."""
        holding = next((h for h in ep.holdings() if (h.model, h.version) == (cmd.model, cmd.version)), None)
        if holding is None or (holding.rank < 0 and len(holding.held) < sum(len(m.chunks) for m in holding.shards)):
            return
        if holding.rank >= 0 and ep.info.kind != "agent":
            log.info("%s: %s@%s withdrawn by the operator; its tensors stay ours until our unpublish",
                     ep.name, cmd.model, cmd.version)
            return
        timeout = ep.drain_timeout_s if self.unpublish_timeout is None else self.unpublish_timeout
        try:
            ep.unpublish(cmd.model, cmd.version, timeout=timeout)
        except Exception as exc:
            log.warning("%s: unpublish of %s@%s failed: %s", ep.name, cmd.model, cmd.version, exc)
            ep.report(cmd, "unpublish_failed", f"{type(exc).__name__}: {exc}", timeout=self.report_timeout)

    @staticmethod
    def refuse(ep, cmd: p.Command) -> str:
        raise EndpointError(f"{ep.name} handles no {cmd.action!r} command (an agent's)")
