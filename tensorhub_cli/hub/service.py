"""The hub service: an asyncio ZeroMQ ROUTER around the pure ``Hub``.

Protocol: one frame in, one ``Reply`` out per request (see ``protocol``). The service
owns everything the state machine must not: the socket, the clock, authentication,
size limits, the periodic expiry sweep, and prometheus metrics. Every refusal is
answered and counted under ``errors.<code>``; no frame a peer sends can raise out of
the receive loop. Ops run one at a time on one thread, so the state machine needs no
locks. A ``Resolved`` reply splices in its version's manifests as encoded once
(``Version.encoded``): the same bytes, without re-encoding a large manifest per reader.

Silence is measured only while the hub listens. The loop runs at least every
``sweep_s`` (the sweep's timer), so a gap of more than two periods between ops and
sweeps means this process did not run (descheduled, paused, swapped): beats sent
meanwhile are still queued behind it, in zmq or the kernel. The gap beyond one period
is excused (``Hub.excuse``) before the next op or sweep judges anyone alive, so a
stalled hub never expires, or plans around, endpoints that went on beating.

Liveness is judged on a path a busy hub cannot starve. Each turn of the loop first
takes every request off the socket (``take``): a heartbeat is answered there and then,
every other op is queued (``backlog``) in arrival order and run by ``work`` for at most
``SLICE_S`` (or ``BATCH`` ops) before the socket is read again; the sweep, too, takes
what the socket holds before it judges anyone. So a beat waits for the rest of one
slice at most, not for the plans queued ahead of it: a long queue of plans delays plans,
never expires an endpoint that beats (contract 6; before, a ROUTER that takes one request
per peer in turn made a beat wait for one op of every busy peer: seconds, at a thousand
readers, and the sweep ran meanwhile).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from . import protocol as p
from .faults import Acked, HubFault, Send
from .machine import Answered, Hub, withdraw_key
from .mustering import key as muster_key

log = logging.getLogger("tensorhub.hub")
BATCH = 256  # queued ops run per turn of the loop, at most
SLICE_S = 0.02  # ... and for at most this long: then beats and the sweep are heard again
INTAKE = 4096  # requests taken off the socket per turn, at most (the rest wait one turn)
# Plain ints, and single-frame calls instead of send/recv_multipart: enum arithmetic and
# pyzmq's multipart wrappers cost ~3 µs a message, a tenth of a cheap op's service time.
_POLLIN, _NOBLOCK, _EVENTS = int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.EVENTS)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK

_DISPATCH = {
    p.Register: "register",
    p.Heartbeat: "heartbeat",
    p.Deregister: "deregister",
    p.Publish: "publish",
    p.Resolve: "resolve",
    p.Plan: "plan",
    p.Progress: "progress",
    p.Cancel: "cancel",
    p.Unpublish: "unpublish",
    p.Versions: "versions",
    p.Sync: "sync",
    p.Load: "load_checkpoint",  # (Hub.load is the per-source read count)
    p.Report: "report",
    p.Note: "note",
    p.Events: "events_since",  # (Hub.events is the log itself)
    p.Withdraw: "withdraw",
}
_CONTROL = (p.Register, p.Heartbeat)  # an endpoint's service socket: where pushes go


class HubService:
    def __init__(self, hub: Hub, token: str, bind: str, *, clock=time.monotonic, sweep_s: float | None = None):
        self.hub = hub
        self._token = token.encode()
        self.bind = bind
        self.clock = clock
        self.sweep_s = sweep_s or max(0.05, hub.config.expiry_s / 5)
        self._ran: float | None = None  # when the loop last ran an op or a sweep
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # zmq drops a peer whose frame exceeds this; frames below it but above MAX_FRAME
        # still get an answer, so a client learns why.
        self._sock.setsockopt(zmq.MAXMSGSIZE, 2 * p.MAX_FRAME)
        self._sock.bind(bind)
        # Ops run on the event loop; the Prometheus HTTP thread reads the hub too, so
        # both take this lock (uncontended but for scrapes: ~0.1 µs an op).
        self.lock = threading.Lock()
        self.idents: dict[str, bytes] = {}
        # deferred answers: (name, model, version) of an Unpublish, a Withdraw's withdraw_key,
        # or a first Plan parked in its swarm's muster (``mustering.key``)
        self.waiters: dict[tuple, list[tuple[bytes, int]]] = {}
        # ops taken off the socket, not run yet (heartbeats never wait here)
        self.backlog: deque[tuple[bytes, p.Request]] = deque()

    def _reply(self, rid: int, body: p.Body) -> bytes:
        if type(body) is p.Resolved:
            return p.resolved_reply(rid, body, self._manifests(body))
        return p.encode(p.Reply(v=p.PROTOCOL_VERSION, rid=rid, body=body))

    def _manifests(self, body: p.Resolved) -> msgspec.Raw:
        """``body.shards`` encoded, from its version's cache: every reader resolves
        each version, and a large model's manifests take milliseconds to encode. The
        cache lives on the ``Version`` whose manifests it encodes (``Version.encoded``)."""
        v = self.hub.models.get(body.model, {}).get(body.version)
        # (no shards: the reader holds the version, ``Resolve.known``; other shards than
        # the version's: never for a reply the hub just made)
        if not body.shards or v is None or v.manifests() != body.shards:
            return p.encode_shards(body.shards)
        if v.encoded is None:
            v.encoded = p.encode_shards(body.shards)
        return v.encoded

    def _refuse(self, rid: int, code: str, message: str) -> bytes:
        self.hub.count(f"errors.{code}")
        return self._reply(rid, p.Error(code=code, message=message))

    def status(self) -> p.StatusReply:
        """A status snapshot, safe from any thread (what metrics scrape)."""
        with self.lock:
            return self.hub.status(self.clock())

    def handle(self, ident: bytes, frames: list[bytes]) -> list[tuple[bytes, bytes]]:
        """One request run now, whatever it is → the frames to send, as (identity,
        payload). Never raises."""
        with self.lock:
            req = self._admit(ident, frames)
            if isinstance(req, list):
                return req
            if type(req.op) is p.Plan:
                self.hub.heard(self.clock(), req.op.name, req.op.incarnation)
            return self._apply(ident, req)

    def take(self, ident: bytes, frames: list[bytes]) -> list[tuple[bytes, bytes]]:
        """One request off the socket: a heartbeat (or a refusal) is answered now, any
        other op joins ``backlog`` for ``work``. Never raises."""
        with self.lock:
            req = self._admit(ident, frames)
            if isinstance(req, list):  # refused
                return req
            if type(req.op) is p.Heartbeat:
                return self._apply(ident, req)
            if type(req.op) is p.Plan:  # a heartbeat too, as of its arrival (``membership.heard``)
                self.hub.heard(self.clock(), req.op.name, req.op.incarnation)
            self.backlog.append((ident, req))
            return []

    def work(self, send, slice_s: float = SLICE_S) -> int:
        """Run queued ops in arrival order, sending each one's frames with ``send``,
        until ``BATCH`` ran or ``slice_s`` (wall time) passed; → how many ran."""
        backlog, lock = self.backlog, self.lock
        deadline = time.perf_counter() + slice_s
        n = 0
        while backlog and n < BATCH:
            ident, req = backlog.popleft()
            with lock:
                out = self._apply(ident, req)
            send(out)
            n += 1
            if time.perf_counter() > deadline:
                break
        return n

    def _admit(self, ident: bytes, frames: list[bytes]) -> p.Request | list[tuple[bytes, bytes]]:
        """The request ``frames`` carry, or the frames of its refusal (malformed, too
        large, another protocol version, a bad token)."""
        if len(frames) != 1:
            return [(ident, self._refuse(0, "malformed", f"expected 1 frame, got {len(frames)}"))]
        frame = frames[0]
        if len(frame) > p.MAX_FRAME:
            return [(ident, self._refuse(0, "too_large", f"frame of {len(frame)} bytes exceeds {p.MAX_FRAME}"))]
        try:
            req = p.decode_request(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [(ident, self._refuse(0, "malformed", f"undecodable request: {exc}"))]
        if req.v != p.PROTOCOL_VERSION:
            return [(ident, self._refuse(req.rid, "version", f"protocol v{req.v} not spoken here (v{p.PROTOCOL_VERSION})"))]
        if not hmac.compare_digest(req.token.encode(), self._token):
            return [(ident, self._refuse(req.rid, "auth", "bad cluster token"))]
        return req

    def _apply(self, ident: bytes, req: p.Request) -> list[tuple[bytes, bytes]]:
        now = self.clock()
        self._listening(now)
        try:
            if isinstance(req.op, p.Status):
                body = self.hub.status(now)
            else:
                body = getattr(self.hub, _DISPATCH[type(req.op)])(now, req.op)
        except HubFault as fault:
            self.hub.count(f"errors.{fault.code}")
            body = fault.as_error()
        except Exception as exc:  # a bug in the state machine must not take the hub down
            log.exception("operation %s failed", type(req.op).__name__)
            return [(ident, self._refuse(req.rid, "internal", f"{type(exc).__name__}: {exc}"))]
        if isinstance(req.op, _CONTROL) and not isinstance(body, p.Error):
            # Pushed commands go to the socket that registers and beats; an endpoint's
            # other socket (its caller's thread) never sees a frame it did not ask for.
            # Only an accepted one: a refused duplicate (conflict, fenced) must not take
            # the live endpoint's route.
            name = req.op.name if isinstance(req.op, p.Heartbeat) else req.op.info.name
            self.idents[name] = ident
        self.hub.count("ops")
        out = []
        if body is None:  # deferred: an unpublish waiting for its drain, a withdrawal for its replicas to go,
            op = req.op  # a plan for its muster to close
            key = withdraw_key(op.model, op.version, op.node) if isinstance(op, p.Withdraw) else (
                muster_key(op) if isinstance(op, p.Plan) else (op.name, op.model, op.version))
            self.waiters.setdefault(key, []).append((ident, req.rid))
        else:
            out.append((ident, self._reply(req.rid, body)))
        return out + self.outbound()

    def outbound(self) -> list[tuple[bytes, bytes]]:
        out = []
        for event in self.hub.take_outbound():
            if isinstance(event, Acked):
                body = p.Ok() if event.ok else p.Error(
                    code="expired", message=f"{event.endpoint} expired before {event.model}@{event.version} drained")
                for ident, rid in self.waiters.pop((event.endpoint, event.model, event.version), []):
                    out.append((ident, self._reply(rid, body)))
            elif isinstance(event, Answered):
                for ident, rid in self.waiters.pop(event.key, []):
                    out.append((ident, self._reply(rid, event.body)))
            elif isinstance(event, Send) and event.endpoint in self.idents:
                out.append((self.idents[event.endpoint], self._reply(0, event.body)))
        return out

    def _listening(self, now: float) -> None:
        """The loop runs now: excuse the time it did not (see the module's docstring)."""
        if self._ran is not None and (deaf := now - self._ran - self.sweep_s) > self.sweep_s:
            self.hub.excuse(now, deaf)
            log.warning("the hub heard nothing for %.2f s (its process stalled): excused from every "
                        "endpoint's silence", deaf)
        self._ran = now

    def muster(self) -> list[tuple[bytes, bytes]]:
        """Answer the plans of every muster due now (``Hub.muster``)."""
        with self.lock:
            self.hub.muster(self.clock())
            return self.outbound()

    def sweep(self) -> list[tuple[bytes, bytes]]:
        with self.lock:
            now = self.clock()
            self._listening(now)
            for name in self.hub.expire(now):
                log.warning("endpoint %s expired", name)
                self.idents.pop(name, None)
            # Drains are also judged by time (the post-restart grace), so settle here too.
            self.hub.settle(now)
            return self.outbound()

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set. Requests are taken from a reader callback on the
        socket's FD, not by a coroutine per request: ``intake`` takes every request zmq
        holds with non-blocking calls (``take``: beats answered, other ops queued), and
        ``turn`` runs one slice of the queue (``work``), takes in again, and reschedules
        itself while ops are left, so timers, signals and beats get in between slices and
        a busy hub pays for one wake-up per slice. The sweep is a timer callback every
        ``sweep_s`` that takes in first; ops never overlap, as all run on this loop.

        zmq's FD is edge-triggered and only says "events may have changed", so an intake
        ends by reading ``zmq.EVENTS`` (which re-arms the FD) and goes on if it says
        requests are waiting; sends can consume the edge, so every turn ends with one."""
        loop = asyncio.get_running_loop()
        sock = self._sock
        fd = sock.getsockopt(zmq.FD)
        sweeper = None
        turning = False  # a turn is scheduled
        mustering: tuple[float, asyncio.TimerHandle] | None = None  # (due, its timer)

        def intake() -> None:
            for _ in range(INTAKE):
                try:
                    ident = sock.recv(_NOBLOCK)
                except zmq.Again:  # (once an intake: cheaper than asking EVENTS per request)
                    if sock.getsockopt(_EVENTS) & _POLLIN:
                        continue
                    return
                # A ROUTER message is the peer's identity, then at least one frame;
                # a frame says whether more follow (cheaper than asking RCVMORE).
                frame = sock.recv(_NOBLOCK, copy=False)
                frames = [frame.bytes]
                while frame.more:
                    frame = sock.recv(_NOBLOCK, copy=False)
                    frames.append(frame.bytes)
                self._send(self.take(ident, frames))
            kick()  # more than INTAKE waiting: the next turn takes the rest

        def kick() -> None:
            nonlocal turning
            if not turning:
                turning = True
                loop.call_soon(turn)

        def turn() -> None:
            nonlocal turning
            turning = False
            self.work(self._send)
            arm()
            intake()
            if self.backlog:
                kick()

        def arm() -> None:
            """A timer for the next muster to close, if one opened (plans parked)."""
            nonlocal mustering
            due = self.hub.due()
            if due is None or (mustering is not None and mustering[0] <= due):
                return
            if mustering is not None:
                mustering[1].cancel()
            mustering = (due, loop.call_later(max(0.0, due - self.clock()), muster))

        def muster() -> None:
            nonlocal mustering
            mustering = None
            self._send(self.muster())
            arm()
            readable()

        def readable() -> None:
            intake()
            if self.backlog and not turning:
                turn()  # (now: a quiet hub answers a request in the callback that took it)

        def sweep() -> None:
            nonlocal sweeper
            intake()  # beats already here count before anyone is judged silent
            self._send(self.sweep())
            sweeper = loop.call_later(self.sweep_s, sweep)
            readable()  # sending may have consumed the FD's edge while requests wait

        loop.add_reader(fd, readable)
        sweeper = loop.call_later(self.sweep_s, sweep)
        loop.call_soon(readable)  # requests that arrived before the reader was added
        try:
            await stop.wait()
        finally:
            loop.remove_reader(fd)
            sweeper.cancel()
            if mustering is not None:
                mustering[1].cancel()
            self.close()

    def close(self) -> None:
        """Close the socket and its context (``serve`` does on its way out; call it for a
        service never served)."""
        self._sock.close(linger=0)
        self._ctx.term()

    def _send(self, frames: list[tuple[bytes, bytes]]) -> None:
        send = self._sock.send
        for to, frame in frames:
            try:
                # A ROUTER never blocks on send: a peer that is gone or over its
                # high-water mark loses the frame, and retries on its own timeout.
                send(to, _MORE_NOBLOCK)
                send(frame, _NOBLOCK)
            except zmq.ZMQError as exc:
                self.hub.count("errors.send")
                log.debug("reply to %r dropped: %s", to, exc)
