"""Reads that outlived their fetch: kept until their engine lets go (contract 3).

Protocol. A read given up on (a failed fetch, a timeout) whose transfer the engine
could not confirm stopped becomes a ``Zombie``: it may still write into its memory and
read from its source, so it stays pinned at the hub. ``add`` keeps one (the fetch loop,
the endpoint's abort); ``reap(call)`` (the service thread, every beat) releases those
whose engine now lets go and, once the last zombie of a version has stopped, sends
``Cancel`` for that version through ``call`` (unless a newer fetch of it owns the pins
now, which ``holds`` says). ``wait_for`` lets a new fetch of the same version wait for
the old reads instead of sharing their pins and memory.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..hub import protocol as p
from ..hub.client import HubError, HubUnreachable
from .fetch import FetchError
from .inflight import Zombie

log = logging.getLogger("tensorhub.endpoint")


class Zombies:
    def __init__(self, name: str, incarnation: str, holds: Callable[[tuple[str, int]], bool],
                 call_timeout_s: float):
        self.name, self.incarnation, self.holds, self.call_timeout_s = name, incarnation, holds, call_timeout_s
        self._live: list[Zombie] = []
        self._lock = threading.Lock()  # the fetch loop adds, the service thread reaps
        self._stopped: dict[tuple[str, int], int] = {}  # zombies of a failed fetch confirmed stopped

    def add(self, *zombies: Zombie) -> None:
        with self._lock:
            self._live.extend(zombies)

    def reap(self, call: Callable[[p.Op, float], p.Body]) -> None:
        """Release what let go; ``Cancel`` a version whose last pinned zombie stopped."""
        with self._lock:
            live = []
            for z in self._live:
                if not z.engine.release(z.xfer):
                    live.append(z)
                elif z.read is not None:
                    key = (z.model, z.version)
                    self._stopped[key] = self._stopped.get(key, 0) + 1
            self._live = live
            waiting = {(z.model, z.version) for z in live if z.read is not None}
            ready = [key for key in self._stopped if key not in waiting]
            for key in ready:
                del self._stopped[key]
        for model, version in ready:
            if self.holds((model, version)):
                continue  # a new fetch of it (started after these stopped) owns the pins now
            try:
                call(p.Cancel(name=self.name, model=model, version=version, incarnation=self.incarnation),
                     self.call_timeout_s)
            except HubUnreachable:
                with self._lock:  # try again next beat
                    self._stopped[(model, version)] = self._stopped.get((model, version), 0) + 1
            except HubError as exc:  # not_found: the version is gone, and its pins with it
                log.debug("%s: cancel of stopped reads of %s@%s: %s", self.name, model, version, exc)

    def wait_for(self, key: tuple[str, int], deadline: float) -> None:
        """Return once no pinned zombie of ``key`` is left; FetchError at ``deadline``."""
        while True:
            with self._lock:
                if not any(z.read is not None and (z.model, z.version) == key for z in self._live):
                    return
            if time.monotonic() >= deadline:
                raise FetchError(f"{self.name}: reads of an earlier fetch of {key[0]}@{key[1]} have not stopped yet")
            time.sleep(0.01)
