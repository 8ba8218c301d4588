"""The endpoint's hub sockets for ``Endpoint.call``: one per calling thread, used only by it.

Why: a thread waiting for a deferred reply (an unpublish's drain, minutes) holds up no
other thread's calls, and one thread's requests reach the hub in the order it sent them
(a publish that timed out is still ahead of the unpublish that withdraws it).

Protocol: ``mine()`` is the calling thread's socket, made (by ``make``) on its first
call; only that thread uses it, and the endpoint never closes it under a live thread
except in ``close()``, which closes every socket (the endpoint is leaving). Sockets of
threads that ended are closed whenever a new one is made: no thread uses them any more.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..hub.client import HubClient


class HubSockets:
    def __init__(self, make: Callable[[], HubClient]):
        self._make = make
        self._local = threading.local()
        self._open: list[tuple[threading.Thread, HubClient]] = []
        self._lock = threading.Lock()

    def mine(self) -> HubClient:
        """This thread's hub socket (made on its first call)."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._make()
            with self._lock:
                for thread, old in self._open:
                    if not thread.is_alive():
                        old.close()
                self._open = [(t, c) for t, c in self._open if t.is_alive()]
                self._open.append((threading.current_thread(), client))
            self._local.client = client
        return client

    def close(self) -> None:
        """Close every socket made so far."""
        with self._lock:
            for _, client in self._open:
                client.close()
            self._open = []
