"""The client library trainers and rollout engines link: ``connect`` → ``Endpoint``.

This package takes explicit addresses only: it reads no cluster state and no spec
(``tensorhub_cli.api.connect`` adds ``connect(cluster=...)`` on top, through
``launch.lookup``). ``connect`` registers with the hub before it returns; see
``endpoint`` for the publish/fetch/unpublish protocol, ``commands`` for the hub's
commands and the ``on_command`` hook.
"""

from __future__ import annotations

import os
from typing import Literal, Optional

from ..hub import protocol as p
from ..layout import LayoutError
from .commands import CommandHandler, SyncCommands
from .endpoint import Endpoint, EndpointError
from .fetch import FetchError

__all__ = ["connect", "CommandHandler", "Endpoint", "EndpointError", "FetchError", "LayoutError", "SyncCommands"]


def connect(hub: str, token: Optional[str] = None, *, name: str, node: Optional[str] = None, role: str = "",
            reliable: bool = True, group: Optional[str] = None, tier: Literal["device", "host"] = "host",
            engine: Optional[str] = None, host: Optional[str] = None, dc: str = "", rack: str = "",
            heartbeat_s: Optional[float] = None, kind: Literal["endpoint", "agent"] = "endpoint",
            **options) -> Endpoint:
    """Join the cluster whose hub is at ``hub`` ("tcp://HOST:PORT") as endpoint ``name``.

    ``host`` is the address we bind and send from (default 127.0.0.1); ``engine``
    defaults to nixl, ``heartbeat_s`` to 1 s. ``options`` go to ``Endpoint`` (the
    timeouts, ``on_command``, ``connect_timeout``, chunk sizes). Raises
    ``EndpointError`` when the hub does not accept the registration within
    ``connect_timeout``."""
    if token is None:
        raise EndpointError("connect(hub=...) needs token=...")
    info = p.EndpointInfo(name=name, node=node or "local", dc=dc, rack=rack, role=role, kind=kind,
                          reliable=reliable, tier=tier, group=group, pid=os.getpid())
    return Endpoint(hub, token, info, host=host or "127.0.0.1", engine=engine or "nixl",
                    heartbeat_s=heartbeat_s or 1.0, **options)
