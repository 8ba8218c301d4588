"""The per-node agent: the node's host-memory tier, an endpoint of kind ``agent``.

Protocol: it opens its store (``agent.store``: its copies as files in /dev/shm) and
re-adopts the complete, verified copies a previous process of it left there (one that
was ``kill -9``ed, or died with the node's other processes), deleting the rest. Then it
joins the hub as ``agent-<node>`` (host tier; reliable unless the node is spot)
through the endpoint library, with the re-adopted copies registered as held *before*
its first registration, so the ``Register`` carries them as holdings, exactly as
after a hub restart (contract 7): the hub rebuilds those versions from them (a
version it forgot comes back READY; one whose manifest differs is refused). Once
registered it asks the hub which of them it took, and drops the others (logged by
name). The endpoint library then heartbeats and re-registers with its holdings after
a hub restart; the hub's commands (retain, fetch, load, discard) run through
``AgentCommands`` (``agent.commands``), which makes its copies in the store.

A restarted agent registers once its dead predecessor expired at the hub (a live
name is refused; the endpoint retries every beat within ``connect_timeout_s``).

SIGTERM/SIGINT: deregister and exit 0 without draining, deleting the store's copies.
``th down`` stops every agent at once, so copies would have nowhere to go; a reader
mid-read from us re-plans (the hub drops our references at once, contract 6).
SIGUSR1 (``th failover``): unpublish every copy with drain first, each within
``drain_timeout_s`` (default 120 s: its readers finish and a retention copy is pulled
elsewhere before ours goes, contract 4), then delete the store's copies and exit 0.

Waits, all arguments of ``run`` (flags of ``python -m tensorhub_cli.agent``):
``connect_timeout_s`` (default 3600 s: an agent may start long before its hub answers),
``heartbeat_s``, ``read_timeout_s``, ``plan_timeout_s``, ``drain_timeout_s`` (the
endpoint's, see ``endpoint.endpoint``). ``store``: the base directory of the store
(default ``$TH_AGENT_STORE``, else /dev/shm/tensorhub); ``cluster`` names the
directory under it (default ``hub-<port>``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Optional

from ..endpoint import Endpoint
from ..hub import protocol as p
from ..hub.client import HubError, HubUnreachable
from .commands import AgentCommands
from .store import Copy, Store, agent_dir

log = logging.getLogger("tensorhub.agent")


class AgentEndpoint(Endpoint):
    """An endpoint that holds ``copies`` (the store's survivors) from its first
    ``Register`` on: they are registered with its engine when the service thread
    first asks for its holdings, which is after the engine exists and before the hub
    hears of us. ``adopted``: those registered; the others were refused locally."""

    def __init__(self, copies: list[Copy], *args, **kw):
        self._pending = list(copies)
        self._adopting = threading.Lock()
        self.adopted: list[Copy] = []
        super().__init__(*args, **kw)

    def holdings(self) -> list[p.Holding]:
        self._adopt()
        return super().holdings()

    def _adopt(self) -> None:
        with self._adopting:
            pending, self._pending = self._pending, []
            for c in pending:
                try:
                    held = self.replicas.register(c.model, c.version, c.world, c.shards, c.rank, c.placed)
                    if c.rank < 0:  # a reader's copy, every chunk verified by the store
                        held.held = set(range(len(c.placed.views)))
                    self.replicas.add(held)
                except Exception as exc:  # (the engine refused the memory): never stop the service thread
                    log.warning("re-adopted copy %s@%s not registered: %s", c.model, c.version, exc)
                else:
                    self.adopted.append(c)


def confirm(ep: AgentEndpoint, store: Store, copies: list[Copy], timeout: float) -> None:
    """Drop each re-adopted copy the hub did not take (its manifest conflicts with the
    version the hub knows, or the engine refused it): nobody would ever discard it."""
    for c in copies:
        try:
            listed = ep.versions(c.model, timeout=timeout)
        except HubError as exc:
            if exc.code != "not_found":
                log.warning("cannot confirm re-adopted copy %s@%s: %s", c.model, c.version, exc)
                continue
            listed = []
        except HubUnreachable as exc:
            log.warning("cannot confirm re-adopted copy %s@%s: %s", c.model, c.version, exc)
            continue
        state = next((v.state for v in listed if v.version == c.version and any(
            h.name == ep.name and h.complete for h in v.holders)), None)
        if state is not None:
            log.info("offered re-adopted copy %s@%s to the hub again: %s", c.model, c.version, state)
            continue
        log.warning("dropped re-adopted copy %s@%s: the hub did not take it (its manifest differs from the "
                    "version the hub knows, or the version was dropped)", c.model, c.version)
        ep.discard(c.model, c.version)
        store.remove(c.model, c.version)


def run(hub: str, token: str, node: str, address: str, dc: str, rack: str, spot: bool, heartbeat_s: float,
        engine: str, *, read_timeout_s: float = 30.0, plan_timeout_s: float = 5.0, drain_timeout_s: float = 120.0,
        connect_timeout_s: float = 3600.0, store: Optional[str] = None, cluster: Optional[str] = None) -> None:
    stopping = threading.Event()
    drain = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    signal.signal(signal.SIGUSR1, lambda *_: (drain.set(), stopping.set()))
    name = f"agent-{node}"
    from ..api import _serve_metrics

    _serve_metrics(None, address)  # $TH_METRICS_PORT: the retention pulls' fetch histograms, on the node's address
    kept = Store.open(agent_dir(name, hub, cluster, store), token)
    log.info("copies are stored in %s", kept.root)
    copies = kept.recover()
    info = p.EndpointInfo(name=name, node=node, dc=dc, rack=rack, role="agent", kind="agent", reliable=not spot,
                          tier="host", pid=os.getpid())
    try:
        ep = AgentEndpoint(copies, hub, token, info, host=address, engine=engine, heartbeat_s=heartbeat_s,
                           read_timeout_s=read_timeout_s, plan_timeout_s=plan_timeout_s,
                           drain_timeout_s=drain_timeout_s, connect_timeout=connect_timeout_s,
                           on_command=AgentCommands(kept))
    except BaseException:
        kept.close()  # the copies stay for the next start
        raise
    log.info("registered %s with hub %s (engine %s)", ep.name, hub, ep.engine.kind)
    for c in copies:
        if not any(c is a for a in ep.adopted):
            kept.remove(c.model, c.version)
    confirm(ep, kept, ep.adopted, ep.call_timeout_s)
    stopping.wait()
    if drain.is_set():
        log.info("draining every copy before leaving (failover)")
    ep.close(drain_timeout=ep.drain_timeout_s if drain.is_set() else 0.0)
    kept.clear()
