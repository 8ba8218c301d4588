"""The per-node agent: registers its node with the hub and keeps it alive.

Protocol: register as ``agent-<node>`` (kind ``agent``, host tier, reliable unless the
node is spot), then heartbeat every ``heartbeat_s``. When the hub answers
``unknown_endpoint`` (it restarted and lost its soft state) the agent registers again;
when the hub is unreachable it keeps trying at the same period. SIGTERM deregisters
(best effort, bounded) and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable

log = logging.getLogger("tensorhub.agent")


class Agent:
    def __init__(self, client: HubClient, info: p.EndpointInfo, heartbeat_s: float):
        self.client = client
        self.info = info
        self.heartbeat_s = heartbeat_s
        self.stopping = threading.Event()
        self.registered = False

    def _beat(self) -> None:
        timeout = max(self.heartbeat_s, 1.0)
        if not self.registered:
            self.client.call(p.Register(info=self.info), timeout=timeout)
            self.registered = True
            log.info("registered %s with hub %s", self.info.name, self.client.address)
            return
        try:
            self.client.call(p.Heartbeat(name=self.info.name), timeout=timeout)
        except HubError as exc:
            if exc.code != "unknown_endpoint":
                raise
            log.warning("hub forgot us (restarted?); registering again")
            self.registered = False
            self._beat()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._beat()
            except HubUnreachable as exc:
                log.warning("%s", exc)
                self.registered = False
            except HubError as exc:
                log.error("hub refused %s: %s", self.info.name, exc)
            self.stopping.wait(self.heartbeat_s)
        try:
            self.client.call(p.Deregister(name=self.info.name), timeout=1.0)
        except (HubError, HubUnreachable):
            pass
        self.client.close()


def agent_info(node: str, dc: str, rack: str, spot: bool) -> p.EndpointInfo:
    return p.EndpointInfo(
        name=f"agent-{node}", node=node, dc=dc, rack=rack, role="agent", kind="agent",
        reliable=not spot, tier="host", pid=os.getpid(),
    )


def install_stop(agent: Agent) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stopping.set())
