"""Blocking request/reply client for the hub (one DEALER socket, explicit timeouts).

Protocol: ``call(op, timeout)`` sends one ``Request`` and returns the matching reply
body, or raises ``HubUnreachable`` after ``timeout`` seconds, or ``HubError`` when
the hub answered with an ``Error``. Replies to other request ids (late answers to a
call that already timed out) are dropped. Frames the hub pushes unasked (``rid == 0``,
commands for agents) are queued in ``pushed``. Not thread-safe: one client per thread.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque

import zmq

from ..errors import HubError, HubUnreachable  # (defined with the rest of the public errors)
from . import protocol as p


class HubClient:
    def __init__(self, address: str, token: str, *, source: str | None = None, ctx: zmq.Context | None = None):
        """``source``: local IP to connect from, so a node's traffic leaves from its own address."""
        self.address = address
        self._token = token
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        endpoint = address
        if source:
            host_port = address.removeprefix("tcp://")
            endpoint = f"tcp://{source}:0;{host_port}"
        self._sock.connect(endpoint)
        self._rids = itertools.count(1)
        self.pushed: deque[p.Body] = deque()

    def send(self, op: p.Op) -> int:
        rid = next(self._rids)
        self._sock.send(p.encode(p.Request(v=p.PROTOCOL_VERSION, token=self._token, rid=rid, op=op)))
        return rid

    def wait(self, rid: int, timeout: float) -> p.Body:
        body = self.reply(rid, timeout)
        if body is None:
            raise HubUnreachable(f"no reply from hub at {self.address} within {timeout:.1f}s")
        return body

    def reply(self, rid: int, timeout: float = 0.0) -> p.Body | None:
        """The reply to ``rid`` if it arrives within ``timeout`` (0: only if already
        here), else None; raises ``HubError`` for an ``Error`` reply."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if not self._sock.poll(max(0, math.ceil(left * 1000))):
                if time.monotonic() >= deadline:
                    return None
                continue
            reply = p.decode_reply(self._sock.recv())
            if reply.rid == 0:
                self.pushed.append(reply.body)
            elif reply.rid == rid:
                if isinstance(reply.body, p.Error):
                    raise HubError(reply.body)
                return reply.body

    def reply_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for any frame to arrive (``reply`` then reads it)."""
        return bool(self._sock.poll(int(timeout * 1000)))

    def call(self, op: p.Op, timeout: float = 5.0) -> p.Body:
        return self.wait(self.send(op), timeout)

    def poll_pushed(self, timeout: float, wake: int | None = None) -> None:
        """Read pushed frames for up to ``timeout`` seconds (agents call this between
        beats); returns early once the file descriptor ``wake`` is readable (it is not
        read: whoever made it readable meant "stop waiting", for good)."""
        if wake is None:
            ready = self._sock.poll(int(timeout * 1000))
        else:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(wake, zmq.POLLIN)
            ready = dict(poller.poll(int(timeout * 1000))).get(self._sock)
        if ready:
            reply = p.decode_reply(self._sock.recv())
            if reply.rid == 0:
                self.pushed.append(reply.body)

    def close(self) -> None:
        self._sock.close(linger=0)


def wait_for_hub(address: str, token: str, timeout: float, alive=lambda: True) -> None:
    """Return once the hub at ``address`` answers a ``Status``; raise ``HubUnreachable``
    after ``timeout`` seconds, or as soon as ``alive()`` says the hub process died."""
    client = HubClient(address, token)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.call(p.Status(), timeout=0.5)
                return
            except HubUnreachable:
                if not alive():
                    raise HubUnreachable(f"hub process for {address} exited during start-up") from None
                if time.monotonic() > deadline:
                    raise HubUnreachable(f"hub at {address} did not answer within {timeout:.0f}s") from None
    finally:
        client.close()
