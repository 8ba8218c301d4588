"""Inside a Ray worker: which TensorHub cluster, which node, which token (no env vars).

Protocol. ``in_ray()`` is true in a process connected to a Ray cluster (a worker, an
actor, or a driver: each runs on a Ray node); ray is never imported here, only looked
for among the loaded modules, so a process without Ray pays nothing. ``options(cluster,
node)`` asks the cluster's follower actor (``<cluster>.follow``, started by ``th up``
with ``launcher: ray``; ``ray_actors.Follower.lookup``) for the ``connect`` options of
an endpoint on ``node``, or, with ``node`` None, on the Ray node this process runs on
(its Ray node id, which the running spec maps to a TensorHub node). ``cluster`` None:
the one TensorHub cluster of this Ray cluster (several: an error naming them). None
when the Ray cluster runs no such TensorHub cluster (the caller then looks on disk).
Every Ray call waits at most ``timeout`` seconds.
"""

from __future__ import annotations

import sys
from typing import Optional

FOLLOW_SUFFIX = ".follow"
LOOKUP_TIMEOUT_S = 15.0


class RayLookupError(LookupError):
    pass


def in_ray() -> bool:
    ray = sys.modules.get("ray")
    try:
        return ray is not None and ray.is_initialized()
    except AttributeError:  # a partly imported ray
        return False


def clusters() -> list[tuple[str, str]]:
    """(cluster, namespace) of every TensorHub cluster this Ray cluster runs."""
    from ray.util import list_named_actors

    return sorted((a["name"][: -len(FOLLOW_SUFFIX)], a["namespace"]) for a in list_named_actors(all_namespaces=True)
                  if a["name"].endswith(FOLLOW_SUFFIX))


def options(cluster: Optional[str], node: Optional[str], timeout: float = LOOKUP_TIMEOUT_S) -> Optional[dict]:
    import ray

    found = [(c, ns) for c, ns in clusters() if cluster in (None, c)]
    if not found:
        return None
    if len(found) > 1:
        raise RayLookupError("this Ray cluster runs several TensorHub clusters: "
                             + ", ".join(sorted({c for c, _ in found})) + "; pass cluster=NAME")
    name, namespace = found[0]
    follower = ray.get_actor(name + FOLLOW_SUFFIX, namespace=namespace)
    here = ray.get_runtime_context().get_node_id()
    try:
        reply = ray.get(follower.lookup.remote(ray_node_id=here, node=node), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RayLookupError(f"cluster {name!r}: its follower did not answer within {timeout:.0f}s") from None
    except ray.exceptions.RayActorError as exc:
        raise RayLookupError(f"cluster {name!r}: its follower is gone ({exc}); `th up` starts it again") from None
    if "error" in reply:
        raise RayLookupError(reply["error"])
    return reply
