"""Reads that outlived their fetch: kept until their engine lets go (contract 3).

Protocol. A read given up on (a failed fetch, a timeout) whose transfer the engine
could not confirm stopped becomes a ``Zombie``: it may still write into its memory and
read from its source, so it stays pinned at the hub.

- ``add(*zombies, origin=held)``: the fetch loop and the endpoint's abort keep them;
  ``origin`` is the replica record of the fetch that left them.
- ``reap(call)`` (the service thread every beat; ``Endpoint.close`` while it waits):
  releases those whose engine now lets go and, once the last zombie of a version has
  stopped, sends ``Cancel`` for that version through ``call`` — unless a newer fetch
  of it (a replica record other than ``origin``) owns our pins there now.
- ``holdings()``: a ``Holding`` per version with zombies still pinned, listing their
  reads, so a re-registration with a restarted hub pins them again (contract 7). The
  hub then records an (empty) reader replica of ours for a version we may have let go;
  once its zombies stopped, ``reap`` withdraws it (an ``Unpublish``, on a thread of its
  own: the hub defers that answer through its restart grace) unless we hold it again.
- ``wait_for(key, deadline, call)``: a new fetch of a version waits until its old reads
  stopped and were cancelled (it cancels them itself rather than wait for a beat), so
  it never shares their pins and memory, and no late ``Cancel`` unpins its own reads.
- ``idle()`` / ``pending()``: whether anything is left to wait for, and what.

A version being cancelled or withdrawn is *claimed* by one thread at a time, so two
reapers (the service thread, ``close``) never send one ``Cancel`` twice, and a fetch
never registers between a reaper's ownership check and its ``Cancel``.

Waits: ``Cancel`` takes ``call_timeout_s``; a withdrawal ``drain_timeout_s``;
``wait_for`` its caller's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from ..errors import HubUnreachable, TensorHubError
from ..hub import protocol as p
from .fetch import FetchError
from .inflight import Zombie

log = logging.getLogger("tensorhub.endpoint")

Key = tuple[str, int]
Call = Callable[[p.Op, float], p.Body]


class Zombies:
    def __init__(self, name: str, incarnation: str, current: Callable[[Key], object], call_timeout_s: float,
                 *, hub_call: Optional[Call] = None, drain_timeout_s: float = 120.0):
        """``current(key)``: the endpoint's replica record of ``key`` now (None: none);
        ``hub_call(op, timeout)``: a hub call from any thread (withdrawals run on their own)."""
        self.name, self.incarnation, self.current = name, incarnation, current
        self.call_timeout_s, self.drain_timeout_s, self.hub_call = call_timeout_s, drain_timeout_s, hub_call
        self._live: list[Zombie] = []
        self._lock = threading.Lock()  # the fetch loop adds, the service thread reaps
        self._origins: dict[Key, object] = {}  # the replica record of the fetch that left a version's zombies
        self._stopped: set[Key] = set()  # every pinned zombie stopped: Cancel due
        self._claimed: set[Key] = set()  # a thread is cancelling or withdrawing it now
        self._restored: set[Key] = set()  # a re-registration pinned its reads: the hub made a replica of ours

    def add(self, *zombies: Zombie, origin: object = None) -> None:
        with self._lock:
            self._live.extend(zombies)
            for z in zombies:
                if z.read is not None and origin is not None:
                    self._origins[(z.model, z.version)] = origin

    def holdings(self) -> list[p.Holding]:
        """Our pinned zombies' reads as holdings, for a Register; see the module."""
        out: dict[Key, p.Holding] = {}
        with self._lock:
            for z in self._live:
                if z.read is None:
                    continue
                key = (z.model, z.version)
                if key not in out:
                    out[key] = p.Holding(model=z.model, version=z.version, world=z.world, shards=list(z.shards),
                                         rank=-1, held=[], reading=[])
                out[key].reading.append(z.read)
            self._restored |= out.keys()
        return list(out.values())

    def reap(self, call: Call) -> None:
        """Release what let go; ``Cancel`` a version whose last pinned zombie stopped."""
        with self._lock:
            live = []
            for z in self._live:
                if not z.engine.release(z.xfer):
                    live.append(z)
                elif z.read is not None:
                    self._stopped.add((z.model, z.version))
            self._live = live
            waiting = {(z.model, z.version) for z in live if z.read is not None}
            ready = [key for key in self._stopped if key not in waiting and key not in self._claimed]
            self._stopped.difference_update(ready)
            self._claimed.update(ready)
        for key in ready:
            self._settle(key, call, withdraw=True)

    def _settle(self, key: Key, call: Call, *, withdraw: bool) -> None:
        """Cancel ``key``'s stopped reads (we hold its claim), then withdraw our replica
        at the hub if only a re-registration made it; releases the claim when done."""
        model, version = key
        with self._lock:
            origin = self._origins.get(key)
        now = self.current(key)
        if now is None or now is origin:  # (else a newer fetch of it owns the pins now)
            try:
                call(p.Cancel(name=self.name, model=model, version=version, incarnation=self.incarnation),
                     self.call_timeout_s)
            except HubUnreachable:
                with self._lock:  # try again next beat
                    self._stopped.add(key)
                    self._claimed.discard(key)
                return
            except TensorHubError as exc:  # not_found: the version is gone, and its pins with it
                log.debug("%s: cancel of stopped reads of %s@%s: %s", self.name, model, version, exc)
        with self._lock:
            self._origins.pop(key, None)
            restored = key in self._restored
            self._restored.discard(key)
        if withdraw and restored and now is None and self.hub_call is not None:
            threading.Thread(target=self._withdraw, args=(key,), name=f"th-withdraw-{self.name}",
                             daemon=True).start()
            return  # the claim is the withdrawal's now
        with self._lock:
            self._claimed.discard(key)

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
                self._claimed.discard(key)

    def wait_for(self, key: Key, deadline: float, call: Call) -> None:
        """Return once no zombie of ``key`` is pinned or being cancelled; FetchError at
        ``deadline``. Stopped reads still to cancel are cancelled here, on ``call``."""
        while True:
            with self._lock:
                mine = not self._busy(key) and key in self._stopped
                if mine:
                    self._stopped.discard(key)
                    self._claimed.add(key)
            if mine:  # our fetch takes the hub's replica over: no withdrawal
                self._settle(key, call, withdraw=False)
            with self._lock:
                if not self._busy(key) and key not in self._stopped:
                    return
            if time.monotonic() >= deadline:
                raise FetchError(f"{self.name}: reads of an earlier fetch of {key[0]}@{key[1]} have not stopped "
                                 "(or been cancelled at the hub) yet")
            if not mine:
                time.sleep(0.01)

    def _busy(self, key: Key) -> bool:
        """(Under the lock.) A zombie of ``key`` still pinned, or a thread settling it."""
        return key in self._claimed or any(z.read is not None and (z.model, z.version) == key for z in self._live)

    def idle(self) -> bool:
        return not self.pending()

    def pending(self) -> list[str]:
        """What is left to wait for, in words (empty: nothing)."""
        with self._lock:
            reads: dict[Key, int] = {}
            for z in self._live:
                if z.read is not None:
                    reads[(z.model, z.version)] = reads.get((z.model, z.version), 0) + 1
            out = [f"{n} read(s) of {m}@{v} not confirmed stopped" for (m, v), n in sorted(reads.items())]
            out += [f"the cancel of stopped reads of {m}@{v}" for m, v in sorted(self._stopped | self._claimed)]
        return out
