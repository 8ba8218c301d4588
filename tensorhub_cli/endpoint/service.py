"""The endpoint's service thread: registration, heartbeats, engine progress, commands.

Protocol. Register (with every holding, so a restarted hub rebuilds our references:
contract 7), then heartbeat every ``heartbeat_s``. ``unknown_endpoint`` means the hub
forgot us: register again. Between beats the thread waits on the hub socket for
pushed ``Command``s in slices of 1 ms while readers are at our memory (the engine's
passive side must progress for peers' reads to finish), 10 ms while we hold memory
nobody asked about lately, 50 ms otherwise. Commands run on a
worker thread, one at a time, through the endpoint's command handler (see
``endpoint.commands``), so a long fetch never stalls heartbeats.

Waits: each Register or Heartbeat waits ``max(heartbeat_s, 1 s)`` for the hub (a
beat must not outlast the next one by much); ``stop`` waits ``join_timeout`` for the
thread and ``deregister_timeout`` for the hub's acknowledgement.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable

log = logging.getLogger("tensorhub.endpoint")


class Service:
    def __init__(self, ep, client: HubClient, heartbeat_s: float, handler, *, hot_s: float = 30.0):
        """``handler(ep, cmd)`` runs each pushed ``Command`` on the worker thread;
        ``hot_s``: how long after a peer's last ask we keep the 1 ms engine pace."""
        self.ep = ep
        self.client = client
        self.heartbeat_s = heartbeat_s
        self.handler = handler
        self.hot_s = hot_s
        self.registered = threading.Event()
        self.stopping = threading.Event()
        self.last_error: str | None = None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"th-service-{ep.name}", daemon=True)
        self._worker = threading.Thread(target=self._work, name=f"th-commands-{ep.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._worker.start()

    def _beat(self) -> None:
        timeout = max(self.heartbeat_s, 1.0)
        if not self.registered.is_set():
            self.client.call(p.Register(info=self.ep.info, holdings=self.ep.holdings()), timeout=timeout)
            self.registered.set()
            return
        try:
            self.client.call(p.Heartbeat(name=self.ep.name), timeout=timeout)
        except HubError as exc:
            if exc.code != "unknown_endpoint":
                raise
            log.warning("%s: hub forgot us (restarted?); registering again with our holdings", self.ep.name)
            self.registered.clear()
            self._beat()

    def _run(self) -> None:
        next_beat = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                try:
                    self._beat()
                    self.last_error = None
                except (HubUnreachable, HubError) as exc:
                    self.last_error = str(exc)
                    log.warning("%s: %s", self.ep.name, exc)
                    if isinstance(exc, HubUnreachable):
                        self.registered.clear()
                next_beat = now + self.heartbeat_s
            holding = self.ep.holds_memory() and self.ep.engine.needs_progress
            try:
                self.client.poll_pushed(self._slice(holding, now))
            except Exception as exc:  # a garbled push must not stop heartbeats
                log.warning("%s: bad frame from hub: %s", self.ep.name, exc)
            while self.client.pushed:
                self.commands.put(self.client.pushed.popleft())
            if holding:
                self.ep.engine.progress()

    def _slice(self, holding: bool, now: float) -> float:
        """How long to wait for hub frames before progressing the engine again. While
        readers are at us (a describe within ``hot_s``) a READ's rendezvous waits at most
        1 ms for us; otherwise 10 ms, as a 1 ms loop costs a few percent of a core per
        holder (docs/design.md, "Measurements behind the defaults")."""
        if not holding:
            return 0.05
        return 0.001 if now - self.ep.peer.last_ask < self.hot_s else 0.01

    def _work(self) -> None:
        while True:
            cmd = self.commands.get()
            if cmd is None:
                return
            try:
                self.handler(self.ep, cmd)
            except Exception:
                log.exception("%s: command %s failed", self.ep.name, cmd)

    def stop(self, *, join_timeout: float = 5.0, deregister_timeout: float = 1.0) -> None:
        """Ends the beats (the service thread is given ``join_timeout`` to finish its
        slice) and tells the hub we left (if it answers within ``deregister_timeout``).
        The worker is not waited for: it runs the commands already queued (against a
        closing endpoint), then ends."""
        self.stopping.set()
        self.commands.put(None)
        self._thread.join(timeout=join_timeout)
        try:
            self.client.call(p.Deregister(name=self.ep.name), timeout=deregister_timeout)
        except (HubError, HubUnreachable):
            pass
        self.client.close()
