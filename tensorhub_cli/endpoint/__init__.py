"""The client library trainers and rollout engines link: ``connect`` → ``Endpoint``."""

from __future__ import annotations

import os
from typing import Literal, Optional

from ..hub import protocol as p
from .endpoint import Endpoint, EndpointError
from .fetch import FetchError
from .layout import LayoutError

__all__ = ["connect", "Endpoint", "EndpointError", "FetchError", "LayoutError"]


def connect(hub: Optional[str] = None, token: Optional[str] = None, *, cluster: Optional[str] = None,
            name: str, node: Optional[str] = None, role: str = "", reliable: bool = True,
            group: Optional[str] = None, tier: Literal["device", "host"] = "host",
            engine: Optional[str] = None, host: Optional[str] = None, dc: str = "", rack: str = "",
            heartbeat_s: Optional[float] = None, kind: Literal["endpoint", "agent"] = "endpoint",
            **options) -> Endpoint:
    """Join a cluster as endpoint ``name``.

    ``connect(hub="tcp://HOST:PORT", token=...)`` names the hub directly (``host`` is
    the address we bind and send from, default 127.0.0.1). ``connect(cluster=NAME,
    node=...)`` reads the hub address, token, engine and the node's place (address,
    rack, DC) from what ``th up`` wrote under ``$TH_HOME``. Raises ``EndpointError``
    when the hub does not accept the registration within ``connect_timeout``."""
    if (hub is None) == (cluster is None):
        raise EndpointError("connect needs exactly one of hub=... or cluster=...")
    if cluster is not None:
        from ..launch.state import read_state, read_token, cluster_dir
        from ..spec import load

        state = read_state(cluster)
        if state is None:
            raise EndpointError(f"cluster {cluster!r} is not running (no state under {cluster_dir(cluster)})")
        spec = load(cluster_dir(cluster) / "spec.yaml")
        if node is None:
            raise EndpointError("connect(cluster=...) needs node=... to place the endpoint")
        try:
            placed = spec.node(node)
        except KeyError:
            raise EndpointError(f"node {node!r} is not in cluster {cluster!r} "
                                f"(nodes: {', '.join(n.name for n in spec.nodes())})") from None
        hub, token = state.hub_address, read_token(cluster)
        host, dc, rack = placed.spec.address, placed.dc, placed.rack
        engine = engine or spec.engine
        heartbeat_s = heartbeat_s or state.heartbeat_s
    if token is None:
        raise EndpointError("connect(hub=...) needs token=...")
    info = p.EndpointInfo(name=name, node=node or "local", dc=dc, rack=rack, role=role, kind=kind,
                          reliable=reliable, tier=tier, group=group, pid=os.getpid())
    return Endpoint(hub, token, info, host=host or "127.0.0.1", engine=engine or "nixl",
                    heartbeat_s=heartbeat_s or 1.0, **options)
