"""What the agent does on the hub's commands: the handler its endpoint runs.

Protocol (on the endpoint's command workers: ``retain`` and ``release`` one at a time
on one, ``fetch`` and ``load`` one at a time on the other; each outcome but
``release``'s goes back to the hub as a ``Report``):

- ``retain``: fetch ``model@version`` into freshly allocated host memory and hold it,
  so an unpublish elsewhere cannot drop a retained version below its copies
  (contract 4). The copy stays until the hub releases it or the agent leaves.
- ``fetch`` (``th sync``): the same, asked by an operator (into what ``accept_sync``
  named, if anything did).
- ``load`` (``th publish --from``): read the safetensors file at ``path`` on this node
  into host memory and publish it as ``model@version`` (``chunk_bytes``, else the
  endpoint's chunk size).
- ``release``: the hub forgot that version: drop our copy at once, no drain.

Waits: ``fetch_timeout`` (default 600 s) bounds a retain or fetch, ``publish_timeout``
(default 10 s) the hub's acceptance of a loaded manifest, ``report_timeout`` (default:
the endpoint's ``call_timeout_s``) each report.
"""

from __future__ import annotations

from typing import Optional

from ..endpoint.commands import SyncCommands, carry_out
from ..hub import protocol as p
from ..layout import allocate


class AgentCommands:
    def __init__(self, *, fetch_timeout: float = 600.0, publish_timeout: float = 10.0,
                 report_timeout: Optional[float] = None):
        self.sync = SyncCommands(fallback=allocate, fetch_timeout=fetch_timeout, report_timeout=report_timeout)
        self.publish_timeout = publish_timeout
        self.report_timeout = report_timeout

    def __call__(self, ep, cmd: p.Command) -> None:
        if cmd.action == "load":
            carry_out(ep, cmd, lambda: self.load(ep, cmd), timeout=self.report_timeout)
        elif cmd.action == "retain":
            carry_out(ep, cmd, lambda: self.sync.fetch_into(ep, cmd), timeout=self.report_timeout)
        else:
            self.sync(ep, cmd)

    def load(self, ep, cmd: p.Command) -> str:
        from safetensors.torch import load_file

        ep.publish(cmd.model, cmd.version, load_file(cmd.path), chunk_bytes=cmd.chunk_bytes or None,
                   timeout=self.publish_timeout)
        return cmd.path
