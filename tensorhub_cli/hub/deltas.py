"""Which planned reads travel as deltas (``Read.base``): a pure rule over the hub's state.

Protocol. ``Bases(hub, v, reader)(source, c)`` names, for a read of chunk c of ``v`` by
``reader`` from ``source``, the version the source should encode the chunk against
(``wire.ReadDelta``), or -1 for the chunk itself. A base is the newest older version of the model that both
endpoints hold chunk c of, whole and verified (a publisher: its shard), neither
draining it, with chunk c of the same size. Deltas are used where the link is dear: by
default only on reads that cross a DC link (mode ``remote``); ``all`` on every read;
``off`` never (``HubConfig.deltas`` per model, else ``HubConfig.default_deltas``; the
spec's ``models[].deltas``). A far DC's feeder rebuilds, and its DC then reads full
chunks from it: one copy per version still crosses, only smaller.

The hub never sees delta bytes: a delta that the reader cannot rebuild, or whose
result fails v+1's digest, is read again in full by the reader (``endpoint.scheduled``),
so this rule may be optimistic (e.g. a source that dropped its base since) at no risk.
"""

from __future__ import annotations

from ..planner.topology import REMOTE, level_between
from .registry import Version
from .state import HubState

MODES = ("off", "remote", "all")


class Bases:
    """``base`` for the reads of one plan answer: what is per reader or per source is
    worked out once (a schedule answers every outstanding read of the reader)."""

    def __init__(self, hub: HubState, v: Version, reader: str):
        self.hub, self.v, self.reader = hub, v, reader
        self.mode = hub.config.deltas.get(v.model, hub.config.default_deltas)
        self.older: list[Version] | None = None  # newest first, assembled
        self.far: dict[str, bool] = {}  # source -> deltas allowed on its link

    def dear(self, source: str) -> bool:
        """May reads from ``source`` be deltas at all (the mode, and the link to it)?"""
        if self.mode == "off":
            return False
        dear = self.far.get(source)
        if dear is None:
            a, b = self.hub.endpoints.get(self.reader), self.hub.endpoints.get(source)
            dear = self.far[source] = a is not None and b is not None and (
                self.mode == "all" or level_between(a.place, b.place) == REMOTE)
        return dear

    def __call__(self, source: str, chunk: int) -> int:
        if not self.dear(source):
            return -1
        if self.older is None:
            self.older = [old for n, old in sorted(self.hub.models.get(self.v.model, {}).items(), reverse=True)
                          if n < self.v.number and old.assembled]
        size = self.v.chunk_nbytes[chunk]
        for old in self.older:
            if chunk < old.nchunks and old.chunk_nbytes[chunk] == size and _holds(old, self.reader, chunk) \
                    and _holds(old, source, chunk):
                return old.number
        return -1


def _holds(v: Version, name: str, chunk: int) -> bool:
    rep = v.replicas.get(name)
    return rep is not None and name not in v.draining and bool(rep.held >> chunk & 1)
