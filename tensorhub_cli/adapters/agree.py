"""One resolution for every rank of a model-parallel engine instance (contract 2).

Protocol. Every rank of ``group`` (vLLM's or SGLang's ``GroupCoordinator``: a
``rank_in_group`` and a ``broadcast_object(obj, src=0)``) calls ``agree`` at the same
point, on the thread that runs the engine's collectives. Rank 0 alone asks the hub:
for ``latest``, the newest READY version (``Endpoint.versions``; not the hub's group
round, which a shard reader never completes: it never holds every chunk), then that
version's resolution (``Endpoint.resolve``); the resolution is broadcast, and each rank
passes it to ``Endpoint.fetch`` as the version. So every rank reads one version and the
hub answers one resolve per instance, not one per rank. None where rank 0 had nothing
to give (no READY version, a number not READY, the hub's refusal: said at INFO); the
ranks then name the version themselves.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tensorhub.adapters")


def agree(ep, model_name: str, version: int | str, group):
    resolved = None
    if group.rank_in_group == 0:
        try:
            number = version
            if version == "latest":
                ready = [v.version for v in ep.versions(model_name) if v.state == "READY"]
                number = max(ready) if ready else None
            if number is not None:
                resolved = ep.resolve(model_name, number, wait=False)
        except Exception as exc:  # (a failed lookup must not leave the other ranks in the broadcast)
            log.info("tensorhub: %s: no version of %s to resolve for the group (%s); each rank names its own",
                     ep.name, model_name, exc)
    return group.broadcast_object(resolved, src=0)
