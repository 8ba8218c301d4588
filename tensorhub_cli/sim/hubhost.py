"""Where the simulated hub's state machine runs: in this process, or in one of its own.

Protocol. A host holds one real ``hub.machine.Hub`` and offers ``HubServer`` five
verbs. ``apply(entry, now)`` serves one queue entry (an operation, a heartbeat batch,
``SWEEP`` or ``MUSTER``) and returns an ``Applied``: the reply's body, the parked plans
the call answered, the hub's next muster close, the CPU the call took in the hub's
process, and for a sweep the endpoints it expired and when each was last heard before
it. ``heard(now, name, incarnation)`` counts a plan's arrival as a heartbeat (no
reply; it is applied before any later ``apply``). ``idle()`` says the simulated hub's
queue is empty: nothing follows at once (no reply). ``counters()`` reads the hub's
counters; ``close()`` ends the host, after which ``counters()`` still gives the last
ones. ``apply`` and ``counters`` are synchronous: once they return, the hub has
applied everything sent before; ``heard`` and ``idle`` are one-way, applied in order
before the next verb.

``HubHere`` runs the hub in this process. ``HubProcess`` runs it in a fresh
interpreter (``python -m tensorhub_cli.sim.hubhost``) holding the hub and nothing
else, over two pipes; each reply waits at most ``CALL_TIMEOUT_S``, and a child that
fails or exits raises ``RuntimeError`` with its message. Why a process: the CPU a call
takes is what the simulation charges to the hub's core, and a deployed hub has a
process of its own: a heap that is its state alone, and a core that can stay awake
while the simulator works (next paragraph). The process alone did not lower the charge
(asleep between calls, a version's calls at 4,096 rollout GPUs were charged 1.00 CPU-s
against 0.92 in the simulator's process); staying awake did. Both hosts take the same
decisions on the same entries; only the CPU they measure differs.

Warm and cold. The same calls cost 3 to 6 times more CPU when other work ran between
them than back to back (1,024 rollout GPUs, 4,646 recorded calls replayed: 0.13 CPU-s
back to back, 0.48 with a walk over 100k dicts between calls, 0.81 with a 64 MiB copy
between them), and a hub process that sleeps on its pipe between calls pays that too:
its core idles and the call that wakes it runs cold (0.16–0.17 CPU-s charged against
0.12 replayed back to back, pinned to its own core or not). A deployed hub with
requests queued serves them back to back, warm; one whose queue is empty waits in
``epoll`` and wakes cold. So the child spins on its pipe, its core awake, from each
reply until ``idle()`` (the simulated queue ran empty), and sleeps on it after: the
CPU charged is a warm call's where the simulated hub is busy and a cold call's where
it would have idled (at 1,024: 0.127 CPU-s spinning against 0.115 replayed). Where
this process may use one core only, the child never spins (it would take that core
from the simulator).

The collector: in this process, full (oldest-generation) passes are not charged
(``FullPasses``): one that starts inside a hub call walks the whole simulator's heap,
which a hub process never walks. In a process of its own every pass is the hub's and
is charged.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import NamedTuple

from ..hub import protocol as p
from ..hub.faults import Answered
from ..hub.machine import Hub, HubFault

SWEEP = None  # a queue entry: the service's periodic expire + settle
MUSTER = "muster"  # a queue entry: close the musters due
CALL_TIMEOUT_S = 60.0

_OPS = {
    p.Register: Hub.register, p.Heartbeat: Hub.heartbeat, p.Deregister: Hub.deregister, p.Publish: Hub.publish,
    p.Resolve: Hub.resolve, p.Plan: Hub.plan, p.Progress: Hub.progress, p.Cancel: Hub.cancel,
}


class Applied(NamedTuple):
    body: object  # the reply's body; None: no reply, or the plan was parked in its muster
    answers: list  # (muster key, body) of parked plans this call answered
    due: float | None  # the hub's next muster close
    cpu_s: float  # process CPU the call took where the hub runs
    expired: list  # (a sweep) endpoints expired
    last_seen: dict  # (a sweep) endpoint -> when the hub last heard it, before the sweep


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


def _serve_entry(hub: Hub, entry, now: float):
    """One queue entry on the hub: (the reply's body, endpoints expired)."""
    if entry is SWEEP:
        expired = hub.expire(now)
        hub.settle(now)
        return None, expired
    if entry == MUSTER:
        hub.muster(now)
        return None, []
    if isinstance(entry, list):  # one beat period's heartbeats, served back to back
        for beat in entry:
            try:
                hub.heartbeat(now, beat)
            except HubFault:
                pass  # (expired meanwhile: a real endpoint would re-register)
        return None, []
    try:
        return _OPS[type(entry)](hub, now, entry), []
    except HubFault as fault:
        return fault.as_error(), []


class HubHere:
    def __init__(self, hub: Hub, *, own_heap: bool = False):
        """``own_heap``: this process holds the hub alone, so the collector's full
        passes are the hub's and are charged."""
        self.hub, self.own_heap = hub, own_heap

    def apply(self, entry, now: float) -> Applied:
        seen = {name: ep.last_seen for name, ep in self.hub.endpoints.items()} if entry is SWEEP else {}
        with FullPasses() as full:
            t0 = time.process_time()
            body, expired = _serve_entry(self.hub, entry, now)
            answers = [(e.key, e.body) for e in self.hub.take_outbound() if isinstance(e, Answered)]
            cpu = time.process_time() - t0 - (0.0 if self.own_heap else full.cpu_s)
        return Applied(body, answers, self.hub.due(), cpu, expired, seen)

    def heard(self, now: float, name: str, incarnation: str) -> None:
        self.hub.heard(now, name, incarnation)

    def idle(self) -> None:
        pass

    def counters(self) -> dict:
        return dict(self.hub.counters)

    def close(self) -> None:
        pass


class HubProcess:
    def __init__(self, hub: Hub, timeout_s: float = CALL_TIMEOUT_S):
        """Starts the child with ``hub`` (pickled: a fresh hub, as a run begins)."""
        self.timeout_s = timeout_s
        down_r, down_w = os.pipe()  # us -> child
        up_r, up_w = os.pipe()  # child -> us
        try:
            spin = "spin" if len(os.sched_getaffinity(0)) >= 2 else "sleep"
            self._proc = subprocess.Popen([sys.executable, "-m", "tensorhub_cli.sim.hubhost", str(down_r), str(up_w),
                                           spin],
                                          pass_fds=(down_r, up_w), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (down_r, down_w, up_r, up_w):
                os.close(fd)
            raise
        os.close(down_r)
        os.close(up_w)
        self._send, self._recv = Connection(down_w, readable=False), Connection(up_r, writable=False)
        self._final: dict | None = None
        self._broken: str | None = None
        self._stop = weakref.finalize(self, _stop, self._proc, self._send, self._recv)
        self._ask(("start", hub))

    def _ask(self, msg):
        if self._broken is not None:
            raise RuntimeError(self._broken)
        try:
            self._send.send(msg)
            if not self._recv.poll(self.timeout_s):
                self._fail(f"did not answer {msg[0]!r} within {self.timeout_s:g}s")
            kind, reply = self._recv.recv()
        except (EOFError, OSError) as exc:
            self._fail(f"exited (rc {self._proc.poll()}): {exc!r}")
        if kind == "failed":
            self._fail(f"failed on {msg[0]!r}: {reply}")
        return reply

    def _fail(self, why: str):
        """Stop the child and raise; every later verb raises the same."""
        self._broken = f"the simulated hub's process (pid {self._proc.pid}) {why}"
        self._stop()
        raise RuntimeError(self._broken) from None

    def apply(self, entry, now: float) -> Applied:
        return self._ask(("apply", entry, now))

    def heard(self, now: float, name: str, incarnation: str) -> None:
        self._tell(("heard", now, name, incarnation))

    def idle(self) -> None:
        self._tell(("idle",))

    def _tell(self, msg) -> None:
        """A one-way verb: the pipe keeps it before the next one; a child gone is left
        for the next ``_ask`` to report."""
        if self._broken is None:
            try:
                self._send.send(msg)
            except OSError:
                pass

    def counters(self) -> dict:
        return dict(self._final) if self._final is not None else self._ask(("counters",))

    def close(self) -> None:
        """Ends the child; once this returns, no process of ours is left. Never raises
        for a child that broke (the verb that met the break raised already)."""
        if self._final is None and self._broken is None and self._stop.alive:
            try:
                self._final = self._ask(("counters",))
            except RuntimeError:
                pass
        self._stop()


def _stop(proc: subprocess.Popen, send: Connection, recv: Connection) -> None:
    send.close()  # the child reads EOF and exits
    recv.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _child(down: Connection, up: Connection, may_spin: bool) -> None:
    here, spin = None, False
    while True:
        try:
            while spin and not down.poll(0):  # (awake, as a hub with requests queued is; EOF ends it too)
                pass
            msg = down.recv()
        except EOFError:
            return
        try:
            if msg[0] == "heard":
                here.heard(*msg[1:])
                continue
            if msg[0] == "idle":
                spin = False
                continue
            if msg[0] == "start":
                here = HubHere(msg[1], own_heap=True)
                reply = None
            elif msg[0] == "apply":
                reply = here.apply(*msg[1:])
                spin = may_spin
            else:
                reply = here.counters()
        except Exception:  # (a bug in the hub: our parent raises it with this text)
            up.send(("failed", traceback.format_exc()[-4000:]))
            return
        up.send(("ok", reply))


if __name__ == "__main__":
    from tensorhub_cli.sim import hubhost  # (the module by its name: what it sends unpickles as ours)

    hubhost._child(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
                   sys.argv[3] == "spin")
