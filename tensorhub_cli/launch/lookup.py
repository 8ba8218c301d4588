"""Where an endpoint of a running cluster connects, from what ``th up`` left on disk.

Protocol. ``endpoint_options(cluster, node)`` reads ``$TH_HOME/<cluster>/``
(``state.json``, ``token``, ``spec.yaml``: the spec as started) and returns the
keyword arguments of ``tensorhub_cli.endpoint.connect`` for an endpoint on ``node``:
``hub``, ``token``, ``host`` (the node's address), ``dc``, ``rack``, ``engine``,
``heartbeat_s`` (``hub.heartbeat_s``), and the endpoint timeouts of the spec's
``endpoints`` section (``read_timeout_s``, ``plan_timeout_s``, ``drain_timeout_s``).
Reads only. Raises ``ClusterLookupError`` (a ``LookupError``) saying what is missing:
the cluster is not running, no node was named, or the node is not in the cluster.

Inside a Ray worker (``ray_lookup``), a cluster this machine has no state of, or a
call that names no node (or no cluster), is answered by the cluster's follower
actor instead: ``node`` (when not named) is the TensorHub node of the Ray node we run
on, and the options then also hold ``node``.
"""

from __future__ import annotations

from typing import Optional

from ..spec import load
from .ray_lookup import RayLookupError, in_ray, options as ray_options
from .state import cluster_dir, read_state, read_token


class ClusterLookupError(LookupError):
    pass


def endpoint_options(cluster: Optional[str], node: Optional[str]) -> dict:
    state = read_state(cluster) if cluster is not None else None
    if (state is None or node is None) and in_ray():
        try:
            found = ray_options(cluster, node)
        except RayLookupError as exc:
            raise ClusterLookupError(str(exc)) from None
        if found is not None:
            return found
    if cluster is None:
        raise ClusterLookupError("no TensorHub cluster runs on this Ray cluster (`th up` a spec with launcher: ray), "
                                 "and connect was given neither hub=... nor cluster=...")
    if state is None:
        raise ClusterLookupError(f"cluster {cluster!r} is not running (no state under {cluster_dir(cluster)})")
    spec = load(cluster_dir(cluster) / "spec.yaml")
    if node is None:
        raise ClusterLookupError("connect(cluster=...) needs node=... to place the endpoint")
    try:
        placed = spec.node(node)
    except KeyError:
        raise ClusterLookupError(f"node {node!r} is not in cluster {cluster!r} "
                                 f"(nodes: {', '.join(n.name for n in spec.nodes())})") from None
    timeouts = spec.endpoints
    return dict(hub=state.hub_address, token=read_token(cluster), host=placed.spec.address, dc=placed.dc,
                rack=placed.rack, engine=spec.engine, heartbeat_s=state.heartbeat_s,
                read_timeout_s=timeouts.read_timeout_s, plan_timeout_s=timeouts.plan_timeout_s,
                drain_timeout_s=timeouts.drain_timeout_s)
