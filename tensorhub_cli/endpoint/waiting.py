"""Naming the version a fetch reads: resolve it at the hub, waiting for it if asked.

Protocol. ``resolve(call, op, deadline=..., each=..., wait=...)`` sends ``op`` (a
``Resolve``) through ``call`` and returns the hub's ``Resolved``. The hub refuses a
version it cannot resolve yet: unknown (``not_found``: never published, or a model
with no READY version for ``latest``), ``not_ready`` (STAGING: shards or chunks still
missing) and, just after a restart, ``rebuilding`` (holders still re-registering) or
``unknown_endpoint`` (we are: the service thread does it within a beat). With
``wait`` those are asked again, with a backoff from ``FIRST_S`` doubling to ``MAX_S``
(so a version is seen at most ``MAX_S`` after it became READY), until ``deadline``;
then ``VersionTimeout`` (a ``TensorHubTimeout`` and a ``VersionNotFound``, carrying
the hub's last code). Without ``wait``, ``not_found`` and ``not_ready`` raise
``VersionNotFound`` at once. Every other refusal (``unavailable``, ``fenced``, ...)
and ``HubUnreachable`` (no answer within ``each`` seconds, the bound of one round
trip) end it as they came.

Nothing is held while waiting: no lock, no memory registered; other calls of the
endpoint go on (each thread has its own hub socket).
"""

from __future__ import annotations

import time
from typing import Callable

from ..errors import HubError, VersionNotFound, VersionTimeout
from ..hub import protocol as p

FIRST_S = 0.02
MAX_S = 0.25
NOT_THERE = ("not_found", "not_ready")
WAITABLE = NOT_THERE + ("rebuilding", "unknown_endpoint")


def resolve(call: Callable[[p.Op, float], p.Body], op: p.Resolve, *, deadline: float, each: float,
            wait: bool, timeout: float) -> p.Resolved:
    """``timeout``: what the caller granted (named in the timeout's message)."""
    what = f"{op.model}@{'latest' if op.version is None else op.version}"
    pause = FIRST_S
    while True:
        try:
            return call(op, max(0.01, min(each, deadline - time.monotonic())))
        except HubError as exc:
            if exc.code not in WAITABLE or (not wait and exc.code not in NOT_THERE):
                raise
            if not wait:
                raise VersionNotFound(exc.error) from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise VersionTimeout(p.Error(code=exc.code, message=(
                    f"{what} did not become READY within {timeout:g}s (the hub's last answer: "
                    f"{exc.error.message})"))) from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, MAX_S)
