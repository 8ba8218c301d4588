"""Publishing a replica: in place, registered where the tensors lie, then announced.

Protocol of ``publish(ep, model, version, state_dict, shard, ...)``
(``Endpoint.publish``): values are tensors (whole), ``layout.Part``s (a box of a
global tensor) or DTensors (each rank registers its local shard in place: ``layouts``).

1. The work pending on the tensors is done: their device's current CUDA stream is
   synchronized, or the caller's ``ready`` events waited for (``streams``).
2. They are hashed and laid out (``layout.lay_out``: small tensors are copied into a
   staging buffer, big ones are not), after no given-up read of a failed fetch may
   still write that memory (``zombies``: it is fenced until then), and registered
   (or a registration reused: ``registrations``).
3. The hub gets the manifest. From then on the caller must not change those tensors
   until ``unpublish`` of that version has returned (contract 3).

A refusal (a ``HubError``: e.g. ``stale``, ``conflict``) leaves nothing registered.
When the hub does not answer within ``timeout`` the publish may still reach it, so it
is withdrawn (``withdraw``: an unpublish with drain, within ``timeout`` again) and
``EndpointError`` raised: saying "withdrawn", the tensors are the caller's again; else
they stay registered as published until the caller's ``unpublish`` returns.

``unpublish_at_hub`` is ``Endpoint.unpublish``'s round trip: the hub's drain, waited for
through hub restarts; the endpoint drops the replica once it returned.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from ..errors import EndpointError, FetchError, HubError, HubUnreachable
from ..hub import protocol as p
from ..layout import lay_out
from ..layout.tensors import device_of
from . import checks, layouts, streams
from .replica import Replica

log = logging.getLogger("tensorhub.endpoint")

# Answers to an unpublish after which the hub holds no reference to the replica.
GONE = frozenset({"not_found", "unknown_endpoint", "expired", "fenced"})


def publish(ep, model: str, version: int, state_dict: dict, shard: Optional[tuple[int, int]], *,
            chunk_bytes: Optional[int], timeout: float, ready) -> p.Manifest:
    """``Endpoint.publish``; see the module."""
    model, version = checks.model(model), checks.version(version)
    state_dict, shard = layouts.published(checks.state_dict(state_dict), shard)
    rank, world = checks.shard(shard)
    chunk_bytes = ep.chunk_bytes if chunk_bytes is None else checks.count(chunk_bytes, "chunk_bytes")
    timeout = checks.seconds(timeout, "timeout")
    ready = streams.events(ready)
    streams.caught_up({device_of(t) for t in layouts.registered(state_dict) if hasattr(t, "is_cuda")}, ready)
    manifest, placed = lay_out(state_dict, chunk_bytes, ep.small_bytes)
    ep.replicas.check_tier(placed, "state_dict")
    busy = ep.replicas.overlapping(placed.regions)
    if busy:
        raise EndpointError(f"these tensors are still published as {busy[0].model}@{busy[0].version}; "
                            "unpublish that version before publishing its memory again")
    try:  # a given-up read of a failed fetch into this memory may still write it
        ep.zombies.wait_for(None, placed.regions, time.monotonic() + timeout, ep.call)
    except FetchError as exc:
        raise EndpointError(f"publish of {model}@{version}: {exc}") from None
    held = ep.replicas.register(model, version, world, [manifest], rank, placed, layouts.registered(state_dict),
                                fill=True)
    try:
        if held.reg.staged:  # lay_out's copies into staging (or a reused buffer's) may still be queued
            streams.caught_up([placed.device], None)
    except BaseException:
        ep.registrations.give_back(held.reg)
        raise
    ep.replicas.add(held)
    try:
        ep.call(p.Publish(name=ep.name, model=model, version=version, manifest=manifest,
                          rank=rank, world=world, incarnation=ep.incarnation), timeout=timeout)
    except (HubError, EndpointError):  # refused, or never sent: the hub holds nothing of it
        ep.replicas.drop(held)
        raise
    except HubUnreachable as exc:
        withdraw(ep, held, timeout, exc)
    except BaseException:  # (an interrupt): the publish may be on its way, so the memory stays ours to serve
        log.warning("%s: publish of %s@%s interrupted; its tensors stay registered until unpublish (or close)",
                    ep.name, model, version)
        raise
    return manifest


def withdraw(ep, held: Replica, timeout: float, cause: BaseException) -> None:
    """A publish whose reply did not come may still reach the hub (it is queued on
    this thread's socket), which would then route readers to our memory. Unpublish it
    there, on the same socket (so after the publish), within ``timeout``; the memory
    is let go only once the hub answered, else it stays registered and published.
    Always raises ``EndpointError``."""
    what = f"{ep.name}: publish of {held.model}@{held.version} not acknowledged within {timeout:g}s ({cause})"
    try:
        ep.call(p.Unpublish(name=ep.name, model=held.model, version=held.version,
                            incarnation=ep.incarnation), timeout=timeout)
    except HubError as exc:
        if exc.code not in GONE:
            raise EndpointError(f"{what}; its withdrawal failed ({exc}): the tensors stay registered as "
                                f"published; call unpublish({held.model!r}, {held.version}) before changing "
                                "or freeing them") from cause
    except BaseException as exc:
        raise EndpointError(f"{what}, nor its withdrawal ({exc}): the tensors stay registered as published "
                            f"(the hub may yet route readers to them); call unpublish({held.model!r}, "
                            f"{held.version}) before changing or freeing them") from cause
    ep.replicas.drop(held)
    raise EndpointError(f"{what}; withdrawn at the hub, the tensors are the caller's again") from cause


def unpublish_at_hub(ep, model: str, version: int, timeout: float) -> None:
    """``Endpoint.unpublish`` at the hub: returns once the hub acknowledged the unpublish
    (its drain: no read of ours in flight), or forgot the version already; through hub
    restarts, within ``timeout`` (then ``EndpointError``: the replica stays registered)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ep.call(p.Unpublish(name=ep.name, model=model, version=version, incarnation=ep.incarnation),
                    timeout=max(0.1, deadline - time.monotonic()))
            return
        except HubUnreachable:
            if time.monotonic() >= deadline:
                raise EndpointError(f"unpublish of {model}@{version} not acknowledged within {timeout:.0f}s; "
                                    "the replica stays registered (readers may still be reading it)") from None
        except HubError as exc:
            if exc.code == "unknown_endpoint":
                time.sleep(0.05)  # (the service thread may not have noticed yet: no hot loop on the hub)
                ep.await_registered(max(0.1, deadline - time.monotonic()))
                continue
            if exc.code != "not_found":  # the hub forgot it already: nothing to drain
                raise
            return
