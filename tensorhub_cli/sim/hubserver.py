"""The real hub (``hub.machine.Hub``) on one simulated core.

Protocol: ``call(op, reply)`` sends an operation from an endpoint: it reaches the hub
``rtt_s / 2`` later, waits its turn (requests are served one at a time, first come
first served, like the service's single event loop), is applied to the real state
machine with the simulated time as ``now``, and ``reply(body)`` runs ``rtt_s / 2``
after the hub is done with it (``None``: no reply is awaited). ``beats(ops)`` sends one
heartbeat period's heartbeats of many endpoints as one batch (fewer events; each is
still a real call). ``body`` is the hub's reply, or ``protocol.Error`` for a
refusal (``HubFault``), exactly as the service would send it. The service's periodic
``expire`` and ``settle`` (the sweep) run on the same core every ``sweep_s``; a
plan the hub parks in a muster (``hub.mustering``) is answered when the hub closes
it, at its ``due()`` time, as the service's timer does.

Liveness is never starved, as in the service: heartbeats and the sweep go ahead of the
queued requests (served next, in their own order), where the service answers beats as
it takes them off its socket and sweeps between slices of its queue. (The service may
finish a slice, ``service.SLICE_S``, first: not modelled.) ``expired`` lists every
expiry (time, name); ``silence_max_s`` is the longest silence of an endpoint ``live``
called alive that any sweep saw (contract 6 needs it under ``expiry_s``).

Hub work has a cost: each call is timed with ``time.process_time`` (the CPU the real
state machine and planner used in this process) and summed per operation kind in
``cpu``. With ``charge`` on, that time (times ``cpu_scale``, plus ``overhead_s`` per
request for decoding, encoding and the socket) also keeps the simulated core busy, so
a hub that cannot keep up delays every reply, as it would: simulated time then depends
a little on this machine's speed, and two runs agree only to that noise. With ``charge``
off a run is a pure function of its inputs.

With ``record``, every queue entry served (and each plan's arrival, a ``Heard``) is
kept in order with its simulated time; ``log(mark)`` hands it to ``sim.alone``, which
replays it on a fresh hub in a process holding nothing else (the CPU charged here also
pays for the simulator's heap crowding the hub's state out of the caches).

The cyclic collector's full passes are not charged (``FullPasses``): one that starts
inside a hub call walks the whole simulator's heap (flows, events, every endpoint's
tables: millions of objects at thousands of readers), which a hub process, whose heap
is its state alone, never walks. (At 1,024 rollout GPUs the collector's passes inside
hub calls, one of them full, were a third of the hub's charged CPU: docs/design.md,
"Schedules".) Young-generation passes stay charged: they walk the objects made since
the last pass, as they would in a hub process, and fall on the hub's calls in
proportion to what those calls allocate.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Callable, NamedTuple

from ..hub import protocol as p
from ..hub.faults import Answered
from ..hub.machine import Hub, HubFault
from ..hub.mustering import key as muster_key
from .events import Loop

_MUSTER = "muster"  # (a queue entry: close the musters due)
_OPS = {
    p.Register: Hub.register, p.Heartbeat: Hub.heartbeat, p.Deregister: Hub.deregister, p.Publish: Hub.publish,
    p.Resolve: Hub.resolve, p.Plan: Hub.plan, p.Progress: Hub.progress, p.Cancel: Hub.cancel,
}


class Heard(NamedTuple):
    """(A logged entry, ``calls_log``: a plan's arrival counted as a heartbeat; not charged.)"""
    name: str
    incarnation: str


class FullPasses:
    """CPU seconds of the collector's full (oldest-generation) passes, counted while
    installed: ``with FullPasses() as full: ...`` then ``full.cpu_s``."""

    def __init__(self):
        self.cpu_s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> "FullPasses":
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._t0 = time.process_time()
            else:
                self.cpu_s += time.process_time() - self._t0


class HubServer:
    def __init__(self, loop: Loop, hub: Hub, *, rtt_s: float, charge: bool, cpu_scale: float = 1.0,
                 overhead_s: float = 0.0, sweep_s: float = 1.0, live: Callable[[str], bool] = lambda name: True,
                 record: bool = False):
        self.loop, self.hub = loop, hub
        self.calls_log: list[tuple] | None = [] if record else None  # (entry, now) served, for ``sim.alone``
        self.rtt_s, self.charge, self.cpu_scale, self.overhead_s = rtt_s, charge, cpu_scale, overhead_s
        self.sweep_s = sweep_s
        self.live = live
        self._queue: deque = deque()
        self._urgent: deque = deque()  # heartbeat batches and sweeps: ahead of the queue
        self._busy = False
        self.cpu: dict[str, float] = {}  # op kind -> process CPU seconds inside the real hub
        self.calls: dict[str, int] = {}
        self.busy_s = 0.0  # simulated seconds the hub core was occupied
        self.max_queue = 0
        self._parked: dict[tuple, list[Callable]] = {}  # a muster's plans: key -> their replies
        self._muster_at: float | None = None  # the close already scheduled
        self.expired: list[tuple[float, str]] = []
        self.silence_max_s = 0.0
        self._sweeping = False

    # --- endpoints' requests ---------------------------------------------------------
    def call(self, op: p.Msg, reply: Callable[[p.Msg], None]) -> None:
        self.loop.after(self.rtt_s / 2, self._arrive, op, reply)

    def _arrive(self, op: p.Msg, reply: Callable | None) -> None:
        if isinstance(op, p.Plan):  # a heartbeat too, as of its arrival (as ``HubService.take``)
            self.hub.heard(self.loop.now, op.name, op.incarnation)
            if self.calls_log is not None:
                self.calls_log.append((Heard(op.name, op.incarnation), self.loop.now))
        self._queue.append((op, reply))
        if len(self._queue) > self.max_queue:
            self.max_queue = len(self._queue)
        if not self._busy:
            self._serve()

    def _arrive_urgent(self, op: list | None) -> None:
        self._urgent.append((op, None))
        if not self._busy:
            self._serve()

    def _serve(self) -> None:
        op, reply = (self._urgent or self._queue).popleft()
        self._busy = True
        now = self.loop.now
        kind = "sweep" if op is None else "heartbeat" if isinstance(op, list) else _MUSTER if op == _MUSTER \
            else type(op).__name__.lower()
        if op is None:  # (measured outside the hub's CPU)
            seen = [now - ep.last_seen for ep in self.hub.endpoints.values() if self.live(ep.name)]
            self.silence_max_s = max(self.silence_max_s, *seen) if seen else self.silence_max_s
        if self.calls_log is not None:
            self.calls_log.append((op, now))
        with FullPasses() as full:
            t0 = time.process_time()
            body = self._apply(op, now)
            if body is None and isinstance(op, p.Plan):  # parked in its swarm's muster
                self._parked.setdefault(muster_key(op), []).append(reply)
                reply = None
            answers = []  # (acks and commands: no simulated endpoint waits on them)
            for event in self.hub.take_outbound():
                if isinstance(event, Answered):
                    answers += [(r, event.body) for r in self._parked.pop(event.key, [])]
            cpu = time.process_time() - t0 - full.cpu_s
        self.cpu[kind] = self.cpu.get(kind, 0.0) + cpu
        n = len(op) if isinstance(op, list) else 1
        self.calls[kind] = self.calls.get(kind, 0) + n
        requests = 0 if op is None or op == _MUSTER else n  # (the sweep and a muster's close: the hub's own timers)
        busy = (cpu * self.cpu_scale + requests * self.overhead_s) if self.charge else 0.0
        self.busy_s += busy
        self.loop.at(now + busy, self._served, body, reply, answers)
        due = self.hub.due()
        if due is not None and (self._muster_at is None or due < self._muster_at):
            self._muster_at = due
            self.loop.at(max(due, now), self._arrive_urgent, _MUSTER)

    def _apply(self, op, now: float):
        """One queue entry on the real hub; the reply's body (None: none, or parked)."""
        if op is None:
            for name in self.hub.expire(now):
                self.expired.append((now, name))
            self.hub.settle(now)
            return None
        if op == _MUSTER:
            self._muster_at = None
            self.hub.muster(now)
            return None
        if isinstance(op, list):  # one beat period's heartbeats, served back to back
            for beat in op:
                try:
                    self.hub.heartbeat(now, beat)
                except HubFault:
                    pass  # (expired meanwhile: a real endpoint would re-register)
            return None
        try:
            return _OPS[type(op)](self.hub, now, op)
        except HubFault as fault:
            return fault.as_error()

    def beats(self, ops: list[p.Heartbeat]) -> None:
        """Heartbeats of many endpoints sent at once: one queue entry, each beat still a
        real ``Hub.heartbeat`` call (and a request's overhead) on the hub core."""
        if ops:
            self.loop.after(self.rtt_s / 2, self._arrive_urgent, ops)

    def _served(self, body, reply: Callable | None, answers=()) -> None:
        if reply is not None:
            self.loop.after(self.rtt_s / 2, reply, body)
        for r, b in answers:
            self.loop.after(self.rtt_s / 2, r, b)
        if self._urgent or self._queue:
            self._serve()
        else:
            self._busy = False

    # --- the service's sweep ---------------------------------------------------------
    def start_sweeps(self) -> None:
        if not self._sweeping:
            self._sweeping = True
            self.loop.after(self.sweep_s, self._sweep)

    def stop_sweeps(self) -> None:
        self._sweeping = False

    def _sweep(self) -> None:
        if not self._sweeping:
            return
        self._arrive_urgent(None)
        self.loop.after(self.sweep_s, self._sweep)

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu.values())

    @classmethod
    def alone(cls, hub: Hub) -> "HubServer":
        """A server that ``replay``s logged entries on ``hub`` outside any simulation (``sim.alone``)."""
        return cls(Loop(), hub, rtt_s=0.0, charge=False)

    def replay(self, entry, now: float) -> bool:
        """One ``calls_log`` entry applied again as it was served; False for a ``Heard``
        (a plan's arrival: uncharged in the run, so not to be timed)."""
        if isinstance(entry, Heard):
            self.hub.heard(now, entry.name, entry.incarnation)
            return False
        self._apply(entry, now)
        self.hub.take_outbound()
        return True

    def log(self, mark: tuple) -> tuple:
        """The recorded calls and where ``mark`` falls in them, for ``sim.alone.cpu_s``."""
        if self.calls_log is None:
            raise RuntimeError("this hub did not record its calls (HubServer(record=True))")
        return self.hub.config, self.calls_log, mark[3]

    def mark(self) -> tuple[float, float, dict[str, int], int]:
        """What the hub spent so far (CPU, busy seconds, calls by kind, entries logged), for ``since``."""
        return self.cpu_s, self.busy_s, dict(self.calls), len(self.calls_log or ())

    def since(self, mark: tuple[float, float, dict[str, int], int]) -> tuple[float, float, dict[str, int]]:
        """What the hub spent after ``mark``: a version's share, setup left out."""
        cpu, busy, calls, _ = mark
        return (self.cpu_s - cpu, self.busy_s - busy,
                {k: n - calls.get(k, 0) for k, n in sorted(self.calls.items()) if n > calls.get(k, 0)})
