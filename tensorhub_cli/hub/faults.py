"""What the hub's state machine hands back besides a reply body.

- ``HubFault``: an operation refused; raised with the state unchanged, answered by the
  service as an ``Error`` with its code.
- ``Acked``: a deferred unpublish acknowledgement, queued once its drain completed
  (``ok``) or its endpoint was dropped meanwhile (not ``ok``).
- ``Answered``: a deferred operator request (``Withdraw``) is answered, for everyone
  waiting on its key.
- ``Send``: a hub → endpoint command (retain, discard, fetch, load, unpublish, replan), pushed
  by the service on the endpoint's control socket.

The outbound kinds are queued on the state and taken with ``take_outbound()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import protocol as p


class HubFault(Exception):
    """An operation refused; the state is unchanged."""

    def __init__(self, code: str, message: str, missing: list[int] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.missing = missing or []

    def as_error(self) -> p.Error:
        return p.Error(code=self.code, message=self.message, missing=self.missing[:1000])


@dataclass(frozen=True)
class Acked:
    """An unpublish is answered: drained (ok), or its endpoint was dropped meanwhile."""

    endpoint: str
    model: str
    version: int
    ok: bool = True


@dataclass(frozen=True)
class Answered:
    """A deferred operator request is answered (a ``Withdraw``): the service sends
    ``body`` to everyone waiting on ``key``."""

    key: tuple
    body: p.Body


@dataclass(frozen=True)
class Send:
    endpoint: str
    body: p.Command
