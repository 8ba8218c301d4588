"""Reads that outlived their fetch, and the memory they may still write (contract 3).

Words. A *zombie* is a transfer given up on (its fetch failed or timed out) that its
engine has not confirmed over: it may still write into the memory it was reading into
and still read from its source. So, until it ends, its source stays pinned at the hub
and its memory stays *fenced*: the registration (and staging) of the replica it was
filling is not handed back to the registration cache, and no fetch or publish of this
endpoint registers memory overlapping it.

Protocol, per version (one ``Left`` record: what a failed fetch left of it):

- ``add(*zombies, origin=held)``: the endpoint's abort keeps a failed fetch's
  unconfirmed reads; ``origin`` is that fetch's replica record, whose registration
  the zombies now own (the abort does not release it).
- ``reap(call)`` (the service thread every beat; ``Endpoint.close`` while it waits):
  asks each engine again; once the last read of a version ended, the origin's
  registration goes back to the cache (``let_go``) and ``Cancel`` unpins the reads at
  the hub through ``call``, unless a newer fetch of that version (a replica record
  other than ``origin``) owns our pins there by then.
- ``holdings()``: a ``Holding`` per version with reads still running, so a
  re-registration with a restarted hub pins them again (contract 7). The hub then
  records an (empty) reader replica of ours; once the reads ended, ``reap``
  withdraws it (an ``Unpublish`` on a thread of its own: the hub defers that answer
  through its restart grace) unless we hold that version again.
- ``wait_for(key, regions, deadline, call)``: a new fetch of ``key`` (or a publish,
  key None) waits until no read of ``key`` is pinned or being cancelled and no zombie
  may write into ``regions``; stopped reads still to cancel it cancels itself.
- ``await_idle(call, timeout)``: ``Endpoint.close`` reaps until nothing is left;
  ``fenced()``: the registrations zombies still own (``close`` leaks them rather
  than deregister memory a read may write); ``idle()`` / ``pending()``.

A version is *wound up* (cancelled, maybe withdrawn) by one thread at a time
(``Left.winding_up``), so two reapers never send one ``Cancel`` twice and a fetch never
registers between a reaper's ownership check and its ``Cancel``.

Waits: ``Cancel`` takes ``call_timeout_s``; a withdrawal ``drain_timeout_s``;
``wait_for`` its caller's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..errors import HubUnreachable, TensorHubError
from ..hub import protocol as p
from .fetch import FetchError
from .inflight import Zombie

log = logging.getLogger("tensorhub.endpoint")

Key = tuple[str, int]
Call = Callable[[p.Op, float], p.Body]


@dataclass
class Left:
    """What a failed fetch left of one version. ``reads`` non-empty: running (pinned,
    origin's memory fenced); empty: stopped, ``Cancel`` due; ``winding_up``: a thread is
    cancelling (or withdrawing) it now, and the record goes when it is done."""

    origin: object = None  # the replica record of the fetch that left them
    reads: list[Zombie] = field(default_factory=list)
    restored: bool = False  # a re-registration pinned them: the hub made a replica of ours
    winding_up: bool = False


class Zombies:
    def __init__(self, name: str, incarnation: str, current: Callable[[Key], object], call_timeout_s: float,
                 *, hub_call: Optional[Call] = None, drain_timeout_s: float = 120.0,
                 let_go: Callable[[object], None] = lambda reg: None):
        """``current(key)``: the endpoint's replica record of ``key`` now (None: none);
        ``hub_call(op, timeout)``: a hub call from any thread (withdrawals run on their
        own); ``let_go(reg)``: hand a fenced registration back once no read writes it."""
        self.name, self.incarnation, self.current = name, incarnation, current
        self.call_timeout_s, self.drain_timeout_s, self.hub_call = call_timeout_s, drain_timeout_s, hub_call
        self.let_go = let_go
        self._lock = threading.Lock()  # the abort adds, the service thread reaps
        self._left: dict[Key, Left] = {}
        self._loose: list[Zombie] = []  # ended reads whose handle the engine would not free yet

    def add(self, *zombies: Zombie, origin: object = None) -> None:
        with self._lock:
            for z in zombies:
                if z.read is None:
                    self._loose.append(z)
                    continue
                left = self._left.setdefault((z.model, z.version), Left())
                left.reads.append(z)
                left.origin = origin if origin is not None else left.origin

    def holdings(self) -> list[p.Holding]:
        """Our running zombies' reads as holdings, for a Register; see the module."""
        out = []
        with self._lock:
            for (model, version), left in self._left.items():
                if not left.reads:
                    continue
                z = left.reads[0]
                out.append(p.Holding(model=model, version=version, world=z.world, shards=list(z.shards), rank=-1,
                                     held=[], reading=[r.read for r in left.reads]))
                left.restored = True
        return out

    def reap(self, call: Call) -> None:
        """Ask the engines again; unfence and ``Cancel`` versions whose last read ended."""
        unfenced, ready = [], []
        with self._lock:
            self._loose = [z for z in self._loose if not z.engine.release(z.xfer)]
            for key, left in self._left.items():
                if left.reads:
                    left.reads = [z for z in left.reads if not z.engine.release(z.xfer)]
                    if not left.reads:
                        unfenced.append(left.origin)
                if not left.reads and not left.winding_up:
                    left.winding_up = True
                    ready.append(key)
        for origin in unfenced:
            self._unfence(origin)
        for key in ready:
            self._wind_up(key, call, withdraw=True)

    def _unfence(self, origin: object) -> None:
        reg = getattr(origin, "reg", None)
        if reg is not None:
            self.let_go(reg)

    def _wind_up(self, key: Key, call: Call, *, withdraw: bool) -> None:
        """Cancel ``key``'s stopped reads (we are its winding-up thread), then withdraw
        our replica at the hub if only a re-registration made it; then forget ``key``."""
        model, version = key
        with self._lock:
            left = self._left[key]
        now = self.current(key)
        if now is None or now is left.origin:  # (else a newer fetch of it owns the pins now)
            try:
                call(p.Cancel(name=self.name, model=model, version=version, incarnation=self.incarnation),
                     self.call_timeout_s)
            except HubUnreachable:
                with self._lock:  # try again next beat
                    left.winding_up = False
                return
            except TensorHubError as exc:  # not_found: the version is gone, and its pins with it
                log.debug("%s: cancel of stopped reads of %s@%s: %s", self.name, model, version, exc)
        if withdraw and left.restored and now is None and self.hub_call is not None:
            threading.Thread(target=self._withdraw, args=(key,), name=f"th-withdraw-{self.name}",
                             daemon=True).start()
            return  # the record is the withdrawal's to forget
        with self._lock:
            self._left.pop(key, None)

    def _withdraw(self, key: Key) -> None:
        model, version = key
        try:
            self.hub_call(p.Unpublish(name=self.name, model=model, version=version, incarnation=self.incarnation),
                          self.drain_timeout_s)
        except HubUnreachable as exc:  # it stays listed (empty) until we deregister
            log.warning("%s: withdrawal of the replica of %s@%s our re-registration made: %s",
                        self.name, model, version, exc)
        except TensorHubError as exc:  # not_found: nothing of ours left there
            log.debug("%s: withdrawal of the replica of %s@%s our re-registration made: %s",
                      self.name, model, version, exc)
        finally:
            with self._lock:
                self._left.pop(key, None)

    def wait_for(self, key: Optional[Key], regions, deadline: float, call: Call) -> None:
        """Return once nothing of ``key`` is pinned or being wound up and no zombie may
        write into ``regions``; FetchError at ``deadline`` naming what is left."""
        while True:
            with self._lock:
                left = self._left.get(key) if key is not None else None
                mine = left is not None and not left.reads and not left.winding_up
                if mine:
                    left.winding_up = True
            if mine:  # our fetch takes the hub's replica over: no withdrawal
                self._wind_up(key, call, withdraw=False)
                continue
            blocked = self._blocking(key, regions)
            if blocked is None:
                return
            if time.monotonic() >= deadline:
                raise FetchError(f"{self.name}: {blocked}; gave up at the deadline")
            time.sleep(0.01)

    def _blocking(self, key: Optional[Key], regions) -> Optional[str]:
        with self._lock:
            if key in self._left:
                return f"reads of an earlier fetch of {key[0]}@{key[1]} have not stopped (or been cancelled) yet"
            for (model, version), left in self._left.items():
                if left.reads and left.origin is not None and left.origin.overlaps(regions):
                    return (f"this memory may still be written by {len(left.reads)} given-up read(s) of "
                            f"{model}@{version} its engine has not confirmed over")
        return None

    def fenced(self) -> list[object]:
        """Registrations that reads still running may write into."""
        with self._lock:
            return [left.origin.reg for left in self._left.values()
                    if left.reads and getattr(left.origin, "reg", None) is not None]

    def await_idle(self, call: Call, timeout: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Reap (on the caller's thread too, so not a beat apart) until nothing is
        left, ``stop()`` or ``timeout`` seconds; then say what was given up on."""
        deadline = time.monotonic() + timeout
        while not self.idle() and time.monotonic() < deadline and not stop():
            self.reap(call)
            time.sleep(0.02)
        left = self.pending()
        if left:
            log.warning("%s: gave up after %.1fs waiting for %s", self.name, timeout, "; ".join(left))

    def idle(self) -> bool:
        return not self.pending()

    def pending(self) -> list[str]:
        """What is left to wait for, in words (empty: nothing)."""
        with self._lock:
            return [f"{len(left.reads)} read(s) of {m}@{v} not confirmed stopped" if left.reads
                    else f"the cancel of stopped reads of {m}@{v}" for (m, v), left in sorted(self._left.items())]
