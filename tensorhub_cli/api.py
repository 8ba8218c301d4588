"""``connect``: join a cluster by its hub's address, or by the name ``th up`` gave it.

Protocol. ``connect(hub="tcp://HOST:PORT", token=..., name=..., ...)`` is
``endpoint.connect`` itself. ``connect(cluster=NAME, node=..., name=..., ...)`` first
looks the cluster up (``launch.lookup``): the hub address, token and the node's place
(address, rack, DC) always come from the cluster; the engine, ``heartbeat_s`` and the
endpoint timeouts come from it unless the caller passes them. Either way it returns a
registered ``Endpoint`` or raises ``EndpointError``.

Imports are deferred to the call: ``import tensorhub_cli`` (every ``th`` command)
must not pay for the endpoint stack.
"""

from __future__ import annotations

from typing import Optional

_CALLER_WINS = ("engine", "heartbeat_s", "read_timeout_s", "plan_timeout_s", "drain_timeout_s")


def connect(hub: Optional[str] = None, token: Optional[str] = None, *, cluster: Optional[str] = None,
            name: str, node: Optional[str] = None, **options):
    """Join a cluster as endpoint ``name``; see the module for the two forms and
    ``endpoint.connect`` for ``options``. Raises ``EndpointError`` when the cluster
    cannot be looked up or the hub does not accept the registration in time."""
    from .endpoint import EndpointError, connect as connect_endpoint

    if (hub is None) == (cluster is None):
        raise EndpointError("connect needs exactly one of hub=... or cluster=...")
    if cluster is not None:
        from .launch.lookup import endpoint_options

        try:
            found = endpoint_options(cluster, node)
        except LookupError as exc:
            raise EndpointError(str(exc)) from None
        for key in _CALLER_WINS:
            if options.get(key):
                found.pop(key)
        options.update(found)
        return connect_endpoint(name=name, node=node, **options)
    return connect_endpoint(hub, token, name=name, node=node, **options)
