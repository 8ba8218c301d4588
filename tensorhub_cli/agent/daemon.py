"""The per-node agent: the node's host-memory tier, an endpoint of kind ``agent``.

Protocol: it joins the hub as ``agent-<node>`` (host tier; reliable unless the node is
spot) through the endpoint library, which registers, heartbeats, re-registers with its
holdings after a hub restart, and runs the hub's commands for it:

- ``retain``: pull ``model@version`` into freshly allocated host memory and hold it,
  so an unpublish elsewhere cannot drop a retained version below its copies (contract 4);
- ``fetch`` (``th sync``): the same, asked by an operator;
- ``load`` (``th publish --from``): read a safetensors file on this node into host
  memory and publish it.

SIGTERM/SIGINT: deregister and exit 0 without draining. ``th down`` stops every agent
at once, so copies would have nowhere to go; a reader mid-read from us re-plans (the
hub drops our references at once, contract 6). SIGUSR1 (``th failover``): unpublish
every copy with drain first, so retention pulls a copy elsewhere before ours goes
(contract 4), then exit 0.
"""

from __future__ import annotations

import logging
import signal
import threading

from ..endpoint import connect

log = logging.getLogger("tensorhub.agent")
FAILOVER_DRAIN_S = 120.0  # per copy: its readers finish and a retention copy is pulled


def run(hub: str, token: str, node: str, address: str, dc: str, rack: str, spot: bool, heartbeat_s: float,
        engine: str, drain_timeout: float = 0.0) -> None:
    stopping = threading.Event()
    drain = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    signal.signal(signal.SIGUSR1, lambda *_: (drain.set(), stopping.set()))
    ep = connect(hub=hub, token=token, name=f"agent-{node}", node=node, role="agent", kind="agent",
                 reliable=not spot, tier="host", host=address, dc=dc, rack=rack, engine=engine,
                 heartbeat_s=heartbeat_s, connect_timeout=3600.0)
    log.info("registered %s with hub %s (engine %s)", ep.name, hub, ep.engine.kind)
    stopping.wait()
    if drain.is_set():
        log.info("draining every copy before leaving (failover)")
    ep.close(drain_timeout=FAILOVER_DRAIN_S if drain.is_set() else drain_timeout)
