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

Hub work has a cost: each call's CPU (``time.process_time`` where the hub runs: the
real state machine and planner) is summed per operation kind in ``cpu``. With
``charge`` on, that time (times ``cpu_scale``, plus ``overhead_s`` per request for
decoding, encoding and the socket) also keeps the simulated core busy, so a hub that
cannot keep up delays every reply, as it would: simulated time then depends a little on
this machine's speed, and two runs agree only to that noise. With ``charge`` off a run
is a pure function of its inputs. ``own_process``: the hub runs in a process of its own
(``hubhost.HubProcess``), where the CPU of a call is the hub's alone, as deployed; else
in this one (``hubhost.HubHere``), where it also pays for the simulator's heap crowding
the hub's state out of the caches (``hubhost``: why; the collector's full passes are
left out there). Either way the hub takes the same decisions. ``close()`` ends the
host; ``counters`` still reads the hub's last counters after it.

With ``record``, every queue entry served (and each plan's arrival, a ``Heard``) is
kept in order with its simulated time; ``log(mark)`` hands it to ``sim.alone``, which
replays it on a fresh hub in a process holding nothing else.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple

from ..hub import protocol as p
from ..hub.machine import Hub
from ..hub.mustering import key as muster_key
from .events import Loop
from .hubhost import MUSTER, SWEEP, HubHere, HubProcess


class Heard(NamedTuple):
    """(A logged entry, ``calls_log``: a plan's arrival counted as a heartbeat; not charged.)"""
    name: str
    incarnation: str


class HubServer:
    def __init__(self, loop: Loop, hub: Hub, *, rtt_s: float, charge: bool, cpu_scale: float = 1.0,
                 overhead_s: float = 0.0, sweep_s: float = 1.0, live: Callable[[str], bool] = lambda name: True,
                 record: bool = False, own_process: bool = False):
        """``hub``: a fresh hub; with ``own_process`` it moves into the child, and ``hub``
        here stays None (read ``counters``)."""
        self.loop, self.config = loop, hub.config
        self.host = HubProcess(hub) if own_process else HubHere(hub)
        self.hub = None if own_process else hub
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
            self.host.heard(self.loop.now, op.name, op.incarnation)
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
        kind = "sweep" if op is SWEEP else "heartbeat" if isinstance(op, list) else "muster" if op == MUSTER \
            else type(op).__name__.lower()
        if op == MUSTER:
            self._muster_at = None
        if self.calls_log is not None:
            self.calls_log.append((op, now))
        done = self.host.apply(op, now)
        if op is SWEEP:  # (measured outside the hub's CPU)
            seen = [now - t for name, t in done.last_seen.items() if self.live(name)]
            self.silence_max_s = max(self.silence_max_s, *seen) if seen else self.silence_max_s
            self.expired += [(now, name) for name in done.expired]
        body = done.body
        if body is None and isinstance(op, p.Plan):  # parked in its swarm's muster
            self._parked.setdefault(muster_key(op), []).append(reply)
            reply = None
        # (acks and commands: no simulated endpoint waits on them)
        answers = [(r, b) for key, b in done.answers for r in self._parked.pop(key, [])]
        self.cpu[kind] = self.cpu.get(kind, 0.0) + done.cpu_s
        n = len(op) if isinstance(op, list) else 1
        self.calls[kind] = self.calls.get(kind, 0) + n
        requests = 0 if op is SWEEP or op == MUSTER else n  # (the sweep and a muster's close: the hub's own timers)
        busy = (done.cpu_s * self.cpu_scale + requests * self.overhead_s) if self.charge else 0.0
        self.busy_s += busy
        self.loop.at(now + busy, self._served, body, reply, answers)
        if done.due is not None and (self._muster_at is None or done.due < self._muster_at):
            self._muster_at = done.due
            self.loop.at(max(done.due, now), self._arrive_urgent, MUSTER)

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
            self.host.idle()  # (a hub process waits cold from here: ``hubhost``, "Warm and cold")

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
        self._arrive_urgent(SWEEP)
        self.loop.after(self.sweep_s, self._sweep)

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu.values())

    @property
    def counters(self) -> dict:
        return self.host.counters()

    def close(self) -> None:
        """End the hub's host (its process, if it has one); ``counters`` keeps its last."""
        self.host.close()

    @classmethod
    def alone(cls, hub: Hub) -> "HubServer":
        """A server that ``replay``s logged entries on ``hub`` outside any simulation (``sim.alone``)."""
        server = cls(Loop(), hub, rtt_s=0.0, charge=False)
        server.host.own_heap = True  # (the replay's process: its heap is the hub's and the log)
        return server

    def replay(self, entry, now: float) -> bool:
        """One ``calls_log`` entry applied again as it was served; False for a ``Heard``
        (a plan's arrival: uncharged in the run, so not to be timed)."""
        if isinstance(entry, Heard):
            self.host.heard(now, entry.name, entry.incarnation)
            return False
        self.host.apply(entry, now)
        return True

    def log(self, mark: tuple) -> tuple:
        """The recorded calls and where ``mark`` falls in them, for ``sim.alone.cpu_s``."""
        if self.calls_log is None:
            raise RuntimeError("this hub did not record its calls (HubServer(record=True))")
        return self.config, self.calls_log, mark[3]

    def mark(self) -> tuple[float, float, dict[str, int], int]:
        """What the hub spent so far (CPU, busy seconds, calls by kind, entries logged), for ``since``."""
        return self.cpu_s, self.busy_s, dict(self.calls), len(self.calls_log or ())

    def since(self, mark: tuple[float, float, dict[str, int], int]) -> tuple[float, float, dict[str, int]]:
        """What the hub spent after ``mark``: a version's share, setup left out."""
        cpu, busy, calls, _ = mark
        return (self.cpu_s - cpu, self.busy_s - busy,
                {k: n - calls.get(k, 0) for k, n in sorted(self.calls.items()) if n > calls.get(k, 0)})
