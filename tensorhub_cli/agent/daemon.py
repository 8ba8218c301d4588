"""The per-node agent: the node's host-memory tier, an endpoint of kind ``agent``.

Protocol: it joins the hub as ``agent-<node>`` (host tier; reliable unless the node is
spot) through the endpoint library, which registers, heartbeats and re-registers with
its holdings after a hub restart; the hub's commands (retain, fetch, load, release)
run through ``AgentCommands`` (``agent.commands``), installed as the endpoint's
command handler.

SIGTERM/SIGINT: deregister and exit 0 without draining. ``th down`` stops every agent
at once, so copies would have nowhere to go; a reader mid-read from us re-plans (the
hub drops our references at once, contract 6). SIGUSR1 (``th failover``): unpublish
every copy with drain first, each within ``drain_timeout_s`` (default 120 s: its
readers finish and a retention copy is pulled elsewhere before ours goes, contract 4),
then exit 0.

Waits, all arguments of ``run`` (flags of ``python -m tensorhub_cli.agent``):
``connect_timeout_s`` (default 3600 s: an agent may start long before its hub answers),
``heartbeat_s``, ``read_timeout_s``, ``plan_timeout_s``, ``drain_timeout_s`` (the
endpoint's, see ``endpoint.endpoint``).
"""

from __future__ import annotations

import logging
import signal
import threading

from ..endpoint import connect
from .commands import AgentCommands

log = logging.getLogger("tensorhub.agent")


def run(hub: str, token: str, node: str, address: str, dc: str, rack: str, spot: bool, heartbeat_s: float,
        engine: str, *, read_timeout_s: float = 30.0, plan_timeout_s: float = 5.0, drain_timeout_s: float = 120.0,
        connect_timeout_s: float = 3600.0) -> None:
    stopping = threading.Event()
    drain = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    signal.signal(signal.SIGUSR1, lambda *_: (drain.set(), stopping.set()))
    ep = connect(hub=hub, token=token, name=f"agent-{node}", node=node, role="agent", kind="agent",
                 reliable=not spot, tier="host", host=address, dc=dc, rack=rack, engine=engine,
                 heartbeat_s=heartbeat_s, read_timeout_s=read_timeout_s, plan_timeout_s=plan_timeout_s,
                 drain_timeout_s=drain_timeout_s, connect_timeout=connect_timeout_s, on_command=AgentCommands())
    log.info("registered %s with hub %s (engine %s)", ep.name, hub, ep.engine.kind)
    stopping.wait()
    if drain.is_set():
        log.info("draining every copy before leaving (failover)")
    ep.close(drain_timeout=ep.drain_timeout_s if drain.is_set() else 0.0)
