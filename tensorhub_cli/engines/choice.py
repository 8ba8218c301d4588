"""Which engine an endpoint moves bytes with: ``make(kind, ...)``.

Every endpoint has a tcp engine (to read holders whose engine differs from its own)
and its own engine: nixl (default) or tcp. NIXL that cannot load (no wheel, a UCX
backend that cannot be created) falls back to tcp with one warning, so a node without
NIXL still joins; ``kind`` other than those two is an error naming it.
"""

from __future__ import annotations

import logging

from ..errors import EndpointError
from .base import Engine
from .tcp import IDLE_S, TcpEngine

log = logging.getLogger("tensorhub.endpoint")


def make(kind: str, name: str, token: str, host: str, conn_idle_s: float = IDLE_S) -> tuple[Engine, TcpEngine]:
    """Our engine, and the tcp engine (the same one when ``kind`` is tcp or NIXL fell back)."""
    tcp = TcpEngine(token, source=host, idle_s=conn_idle_s)
    if kind == "tcp":
        return tcp, tcp
    if kind != "nixl":
        raise EndpointError(f"engine {kind!r} is not one of: nixl, tcp")
    try:
        from .nixl import NixlEngine

        return NixlEngine(name), tcp
    except Exception as exc:  # an ImportError, or a backend UCX cannot create
        log.warning("NIXL unavailable (%s); this endpoint falls back to the tcp engine", exc)
        return tcp, tcp
