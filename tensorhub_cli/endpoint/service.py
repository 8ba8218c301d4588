"""The endpoint's service thread: registration, heartbeats, engine progress, commands.

Protocol. Register (with every holding, so a restarted hub rebuilds our references:
contract 7), then heartbeat every ``heartbeat_s``, every op carrying our incarnation.
``unknown_endpoint`` means the hub forgot us: register again. A beat whose reply is
slow or lost changes nothing: we keep beating, and stay registered (clearing it would
make fetches wait for a registration the hub never needed). Were we expired meanwhile,
the next beat meets ``unknown_endpoint``; a Register repeated with the same incarnation
keeps every pin and pending unpublish at the hub (contract 3). ``fenced`` means another
process replaced us under our name: the thread stops for good (no more beats), and
``fenced`` says why, so fetches in progress and later calls fail naming it. Each beat
also reaps reads a failed fetch left behind (``Endpoint.reap``), and carries how far
each fetch running here is (``Endpoint.filling``: operators watch it at the hub, as a
reader reports to the hub once per fetch, at its end). The hub takes any
plan of ours for a beat too: a beat falling due less than ``heartbeat_s`` after the
hub answered one of our plans (``Endpoint.heard``) is put off to a period after that
answer, so the hub still hears from us at least once a period.

A refusal no retry can change (``FINAL``: ``auth``, a bad cluster token; ``version``,
a protocol the hub does not speak) also stops the thread at once, with one log line;
``refused`` keeps the answer, and ``wait_registered`` raises it as a ``HubError`` to whoever
waits for the registration (``connect``) instead of letting them wait out their timeout.

Between beats the thread waits on the hub socket for pushed ``Command``s in slices of
50 ms (``stop`` cuts a slice short through a pipe, so closing an endpoint never waits
one out). Each slice it also sets the pace at which the engine's passive side is progressed
(an engine that ``needs_progress``: peers' reads of our memory stall without it), which
the engine's own watcher thread keeps (``Engine.pace``): every 1 ms (``HOT_S``) while
readers are at our memory (a peer's ask within ``hot_s``; the ask itself sets it at
once: ``Endpoint``), every 10 ms (``WARM_S``) while we hold memory nobody asked about
lately, not at all when we hold none. A ``replan`` (the hub dropped a source of our
reads) is no one's handler's: the thread wakes the fetch filling that version
(``Replica.replan``). Other commands run on worker threads through the
endpoint's command handler (see ``endpoint.commands``), so a long fetch never stalls
heartbeats: ``retain`` and
``discard`` on one worker, every other command on another, each worker one command at
a time in the order they came. A retention pull (which an unpublish elsewhere waits
for, contract 4) thus never queues behind a ``th sync`` fetch of up to 600 s.

Waits: each Register or Heartbeat waits ``max(heartbeat_s, 1 s)`` for the hub (a
beat must not outlast the next one by much); ``stop`` waits ``join_timeout`` for the
thread and ``deregister_timeout`` for the hub's acknowledgement. The hub socket is the
thread's: ``stop`` deregisters and closes it only once the thread has ended (a ZeroMQ
socket used from two threads, or closed under one, can crash the process); a thread
still inside a call then is left to close it itself, and we do not deregister (the
hub expires us).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable

log = logging.getLogger("tensorhub.endpoint")
FINAL = frozenset({"auth", "version"})  # refusals the same request will always get
HOT_S = 1e-3  # the engine's pace while peers read our memory: a READ's rendezvous waits at most this for us
WARM_S = 1e-2  # ... while we hold memory nobody asked about lately
SLICE_S = 0.05  # how long the thread waits on the hub socket between its other duties


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
        # Registrations accepted so far: one more means the hub restarted (or forgot
        # us), and a request sent before it may have died with the old hub.
        self.registrations = 0
        self.stopping = threading.Event()
        self.last_error: str | None = None
        self.fenced: str | None = None  # the hub's reason, once another process replaced us
        self.refused: p.Error | None = None  # a FINAL refusal: the thread stopped
        self._registration_seen = threading.Condition()  # notified when ``registered`` is set or ``refused``
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # fetch, load
        self.retention: queue.SimpleQueue = queue.SimpleQueue()  # retain, discard
        self._exit_lock = threading.Lock()
        self._exited = False  # the thread no longer touches the socket
        self._orphaned = False  # stop gave up waiting: the thread closes the socket on its way out
        # stop writes a byte to end the thread's wait on the hub socket at once; both ends
        # close with the socket, whoever closes it (by then nothing writes any more)
        self._wake, self._waker = os.pipe()
        os.set_blocking(self._waker, False)
        self._thread = threading.Thread(target=self._run, name=f"th-service-{ep.name}", daemon=True)
        self._worker = threading.Thread(target=self._work, name=f"th-commands-{ep.name}", daemon=True)
        self._retainer = threading.Thread(target=self._work, args=(self.retention,),
                                          name=f"th-retention-{ep.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._worker.start()
        self._retainer.start()

    def _beat(self) -> None:
        timeout = max(self.heartbeat_s, 1.0)
        if not self.registered.is_set():
            self.client.call(p.Register(info=self.ep.info, holdings=self.ep.holdings()), timeout=timeout)
            self.registrations += 1
            with self._registration_seen:
                self.registered.set()
                self._registration_seen.notify_all()
            return
        try:
            self.client.call(p.Heartbeat(name=self.ep.name, incarnation=self.ep.incarnation,
                                         filling=self.ep.filling()), timeout=timeout)
        except HubError as exc:
            if exc.code != "unknown_endpoint":
                raise
            log.warning("%s: hub forgot us (restarted?); registering again with our holdings", self.ep.name)
            self.registered.clear()
            self._beat()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._exit_lock:
                self._exited = True
                if self._orphaned:
                    self._close()

    def _close(self) -> None:
        self.client.close()
        os.close(self._wake)
        os.close(self._waker)

    def _reap(self) -> None:
        """Reads a failed fetch left behind: released, and unpinned once stopped (once a
        beat period, beat or not)."""
        try:
            self.ep.reap(lambda op, timeout: self.client.call(op, timeout=timeout))
        except Exception:
            log.exception("%s: reaping stopped reads failed", self.ep.name)

    def _loop(self) -> None:
        next_beat = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            heard = self.ep.heard_at
            if now >= next_beat and now - heard < self.heartbeat_s and self.registered.is_set():
                # An answered plan was our beat (the hub took it for one): the next one is
                # due a period after it, so the hub never goes longer without hearing from us.
                next_beat = heard + self.heartbeat_s
                self._reap()
            if now >= next_beat:
                try:
                    self._beat()
                    self.last_error = None
                except (HubUnreachable, HubError) as exc:
                    self.last_error = str(exc)
                    if isinstance(exc, HubError) and exc.code == "fenced":
                        self.fenced = f"{self.ep.name} was fenced by the hub: {exc.error.message}"
                        log.error("%s; this endpoint stops", self.fenced)
                        return
                    if isinstance(exc, HubError) and exc.code in FINAL:
                        self._refuse(exc)
                        return
                    log.warning("%s: %s", self.ep.name, exc)
                next_beat = now + self.heartbeat_s
                self._reap()
            if self.ep.engine.needs_progress:
                self._pace(now)
            try:
                self.client.poll_pushed(SLICE_S, wake=self._wake)
            except Exception as exc:  # a garbled push must not stop heartbeats
                log.warning("%s: bad frame from hub: %s", self.ep.name, exc)
            while self.client.pushed:
                cmd = self.client.pushed.popleft()
                action = getattr(cmd, "action", None)
                if action == "replan":
                    self._replan(cmd)
                    continue
                (self.retention if action in ("retain", "discard") else self.commands).put(cmd)

    def _replan(self, cmd: p.Command) -> None:
        """Wake the fetch filling ``cmd``'s version to ask for a new plan (quick: it only
        queues an event); none filling it (over, or never ours), nothing to do."""
        held = self.ep.replicas.get((cmd.model, cmd.version))
        wake = held.replan if held is not None else None
        if wake is not None:
            wake()

    def _refuse(self, exc: HubError) -> None:
        why = p.Error(code=exc.code, message=f"the hub at {self.client.address} refused {self.ep.name}: "
                                             f"{exc.error.message} (final: no retry can change it)")
        log.error("%s: %s", why.code, why.message)
        with self._registration_seen:
            self.refused = why
            self._registration_seen.notify_all()

    def wait_registered(self, timeout: float) -> bool:
        """True once registered within ``timeout``, False if not; raises the hub's
        ``HubError`` at once when it refused us for good (``refused``)."""
        with self._registration_seen:
            self._registration_seen.wait_for(lambda: self.registered.is_set() or self.refused is not None, timeout)
            if self.refused is not None:
                raise HubError(self.refused)
            return self.registered.is_set()

    def _pace(self, now: float) -> None:
        """Set the engine's serving pace (see the module): a 1 ms loop costs a few percent
        of a core per holder (docs/design.md, "Measurements behind the defaults"), so only
        while readers are at us."""
        asked = self.ep.peer.last_ask
        if not self.ep.holds_memory():
            pace = None
        else:
            pace = HOT_S if now - asked < self.hot_s else WARM_S
        self.ep.engine.pace(pace)
        if pace != HOT_S and self.ep.peer.last_ask != asked:  # (an ask came meanwhile: its pace stands)
            self.ep.engine.pace(HOT_S)

    def _work(self, commands: queue.SimpleQueue | None = None) -> None:
        commands = self.commands if commands is None else commands
        while True:
            cmd = commands.get()
            if cmd is None:
                return
            try:
                self.handler(self.ep, cmd)
            except Exception:
                log.exception("%s: command %s failed", self.ep.name, cmd)

    def stop(self, *, join_timeout: float = 5.0, deregister_timeout: float = 1.0) -> None:
        """Ends the beats (the service thread is given ``join_timeout`` to finish its
        slice) and tells the hub we left (if it answers within ``deregister_timeout``).
        The workers are not waited for: they run the commands already queued (against a
        closing endpoint), then end."""
        if self.stopping.is_set():
            return  # stopped already (the pipe may be closed)
        self.stopping.set()
        os.write(self._waker, b"x")
        self.commands.put(None)
        self.retention.put(None)
        self._thread.join(timeout=join_timeout)
        with self._exit_lock:
            if not self._exited:
                log.warning("%s: service thread still busy after %.1fs; it closes its socket when done",
                            self.ep.name, join_timeout)
                self._orphaned = True
                return
        if self.fenced or self.refused:  # the hub would refuse it: nothing of ours is left there
            self._close()
            return
        try:
            self.client.call(p.Deregister(name=self.ep.name, incarnation=self.ep.info.incarnation),
                             timeout=deregister_timeout)
        except (HubError, HubUnreachable):
            pass
        self._close()
