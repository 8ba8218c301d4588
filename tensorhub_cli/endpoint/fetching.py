"""A plain fetch around the transfer loop: name the version, claim it, set up the
destination, run ``Fetch``, and on failure leave nothing behind (``Endpoint.fetch``).

Protocol of ``fetch(ep, model, version, into=..., ...)`` (the caller's thread):

1. Resolve the version at the hub (``resolve``, through ``waiting``; with the endpoint's
   group unless the caller names another: contract 2), naming the versions we hold
   whole, so that one of those comes back without its manifests (``Resolve.known``).
   A version passed as a resolution (``Endpoint.resolve``'s answer, in this process or
   another member's: an engine's workers share one) is not resolved again.
2. *Claim* it (``Replicas.claim``): one fetch of a version at a time between "is it held?" and
   holding it. A fetch of a version another thread of this endpoint is filling waits
   for that one and takes its outcome: a complete replica in this memory returns at
   once (nothing read); one in other memory is an ``EndpointError``.
3. Set up: place ``into`` (a ``LayoutError`` here writes nothing), unpublish (drain)
   any replica of ours in overlapping memory, and wait until no given-up read of an
   earlier fetch may still write into it (``Zombies.wait_for``: the memory is fenced
   until its engine reports those reads over); then register (or reuse a registration:
   ``registrations``) and add the replica.
4. Run the transfer loop (``fetch``). On any failure, ``abort``: stop the reads;
   those the engine cannot confirm over become zombies, which keep their pins at the
   hub and own the replica's registration (fenced) until they end; the others are
   unpinned now; then the partial replica is withdrawn at the hub *with its drain*
   (peers may be reading the chunks it served), waited for while the hub answers our
   heartbeats, within ``drain_timeout_s``, before it is dropped. The caller then gets
   ``FetchError`` and owns ``into`` again (its contents undefined).
"""

from __future__ import annotations

import logging
import time

import msgspec
from typing import Callable, Optional

from ..errors import EndpointError, FetchError, HubError, HubUnreachable, LayoutError
from ..hub import protocol as p
from . import checks, layouts, metrics, streams, waiting
from .fetch import Fetch
from .scheduled import ScheduledFetch
from .replica import Replica

log = logging.getLogger("tensorhub.endpoint")


def fetch(ep, model: str, version: int | str | p.Resolved, *, into: dict | Callable, group: Optional[str],
          timeout: float, wait: bool, window: int, read_timeout: Optional[float], plan_timeout: Optional[float],
          resolve_timeout: float) -> int:
    """``Endpoint.fetch`` without a collective stage; see the module."""
    model, number, given, into, group, timeout, window, read_timeout, plan_timeout, resolve_timeout = \
        checks.fetch_args(model, version, into, group, timeout, window, read_timeout, plan_timeout,
                          resolve_timeout)
    started = time.monotonic()
    deadline = started + timeout
    resolved = given or resolve(ep, model, number, group=group, deadline=deadline,
                                each=min(resolve_timeout, timeout), wait=wait, timeout=timeout)
    resolved_at = time.monotonic()
    with ep.replicas.claim((model, resolved.version), deadline):
        held = _filled(ep, (model, resolved.version), deadline)
        if held is not None and held.complete and (
                callable(into) or {t.data_ptr() for t in layouts.registered(into) if t.nbytes}
                <= {r.addr for r in held.placed.regions}):
            streams.reached(held.placed.device, held.written)  # (another thread's scatters, on its stream)
            ep.last_fetch = {"bytes": 0, "reads": 0, "corrupt": 0, "failed": 0, "from_publishers": 0,
                             **metrics.stages(started, resolved_at, resolved_at, {}, time.monotonic())}
            return resolved.version  # already a complete holder of it (in this memory, if one was given)
        if held is not None:
            raise EndpointError(f"{ep.name} already holds {model}@{resolved.version} in other memory "
                                "(or is still fetching it); unpublish it first")
        held = set_up(ep, resolved, into, deadline)
    set_up_at = time.monotonic()
    job = (ScheduledFetch if getattr(ep, "schedule", True) else Fetch)(ep, held, deadline, window,
                read_timeout=ep.read_timeout_s if read_timeout is None else read_timeout,
                plan_timeout=ep.plan_timeout_s if plan_timeout is None else plan_timeout,
                describe_timeout=ep.call_timeout_s)
    try:
        job.run()
    except BaseException as exc:
        abort(ep, job, held)
        if isinstance(exc, FetchError):
            raise FetchError(f"{ep.name}: fetch of {model}@{resolved.version} failed: {exc}; "
                             "the destination holds no version") from None
        raise
    streams.reached(held.placed.device, held.written)  # the last scatter, before the caller's next kernel
    ep.last_fetch = {**job.stats, **metrics.stages(started, resolved_at, set_up_at, job.times, time.monotonic())}
    metrics.observe(ep.last_fetch)
    return resolved.version


def resolve(ep, model: str, number: Optional[int], *, group: Optional[str], deadline: float, each: float,
            wait: bool, timeout: float) -> p.Resolved:
    """Step 1: the version's number and manifests (``waiting``), naming the versions we
    hold whole, so one of those comes back without its manifests and we fill them in
    from our replica (``Resolve.known``)."""
    def ask(known: dict[int, int]) -> p.Resolved:
        return waiting.resolve(ep.call, p.Resolve(name=ep.name, model=model, version=number, group=group,
                                                  known=known),
                               deadline=deadline, each=each, wait=bool(wait), timeout=timeout)

    holding = {h.version: h for h in ep.replicas.all() if h.model == model and h.rank < 0 and h.complete}
    resolved = ask({n: h.digest for n, h in holding.items()})
    if not resolved.shards:  # one we hold: its manifests are ours (or, let go meanwhile, ask for them)
        mine = holding.get(resolved.version)
        resolved = ask({}) if mine is None or mine.dropped else msgspec.structs.replace(resolved, shards=mine.shards)
    return resolved


def _filled(ep, key: tuple[str, int], deadline: float) -> Optional[Replica]:
    """Our replica of ``key`` once no other thread is filling it (its outcome is ours:
    a complete replica or none), or None."""
    held = ep.replicas.get(key)
    while held is not None and not held.complete and time.monotonic() < deadline:
        time.sleep(0.05)  # (a retention pull beside a `th sync`, on the agent's two workers)
        held = ep.replicas.get(key)
    return held


def set_up(ep, resolved: p.Resolved, into, deadline: float, *, whole: bool = False) -> Replica:
    """Place ``into``, drain what of ours overlaps it, wait out the fences on it, then
    register and add the replica (step 3). ``whole``: refuse a destination in another
    layout than the publishers' (a collective stage shares whole chunks)."""
    key = (resolved.model, resolved.version)
    if callable(into):  # a destination made to measure (agents' host copies)
        into = into(resolved.shards)
    placed = layouts.place(resolved.shards, into)  # LayoutError here: nothing written, nothing held
    if whole and placed.wanted is not None:
        raise LayoutError("a collective fetch fills the publishers' layout (whole tensors); fetch a destination "
                          "in another layout without collective=", [f"{key[0]}@{key[1]}: destination in another "
                                                                   "layout"])
    ep.replicas.check_tier(placed, "into")
    for old in ep.replicas.overlapping(placed.regions):
        ep.unpublish(old.model, old.version, timeout=max(1.0, deadline - time.monotonic()))
    ep.zombies.wait_for(key, placed.regions, deadline, ep.call)
    held = ep.replicas.register(resolved.model, resolved.version, resolved.world, resolved.shards, -1, placed,
                                layouts.registered(into))
    ep.replicas.add(held)
    return held


def abort(ep, job: Fetch, held: Replica) -> None:
    """A failed fetch leaves no replica (step 4 of the module)."""
    left = job.stop(timeout=ep.call_timeout_s)
    if left:
        log.warning("%s: %d read(s) of %s@%s did not end within %.1fs; they stay pinned, and their memory "
                    "fenced, until their engine reports them over", ep.name, len(left), held.model, held.version,
                    ep.call_timeout_s)
        ep.zombies.add(*left, origin=held)  # (they own its registration now)
        release: p.Op = job.unpinned()
    else:
        release = p.Cancel(name=ep.name, model=held.model, version=held.version, incarnation=ep.incarnation)
    try:
        ep.call(release, timeout=ep.call_timeout_s)
    except (HubError, HubUnreachable) as exc:
        log.warning("%s after a failed fetch: %s", type(release).__name__, exc)
    _withdraw(ep, held)
    ep.replicas.drop(held, registration="keep" if left else "give_back")


def _withdraw(ep, held: Replica) -> None:
    """Unpublish the partial replica at the hub and wait for its drain: peers may be
    reading chunks it served. The wait lasts while the hub answers our heartbeats (it
    is draining, not gone), up to ``drain_timeout_s``; a hub that answers nothing is
    not waited for past one ``call_timeout_s`` (a restarted hub pins nothing of a
    replica no one re-registers, and a reader of memory we no longer serve fails, or
    its checksum does)."""
    op = p.Unpublish(name=ep.name, model=held.model, version=held.version, incarnation=ep.incarnation)
    deadline = time.monotonic() + ep.drain_timeout_s
    while True:
        try:
            ep.call(op, timeout=ep.call_timeout_s)
            return
        except HubUnreachable as exc:
            if ep.service.last_error is not None or time.monotonic() >= deadline:
                log.warning("%s: withdrawing the partial replica of %s@%s after a failed fetch: %s", ep.name,
                            held.model, held.version, exc)
                return
        except (HubError, EndpointError) as exc:  # not_found, unknown_endpoint: nothing of ours to drain
            log.debug("%s: withdrawing the partial replica of %s@%s: %s", ep.name, held.model, held.version, exc)
            return
