"""The endpoint's table of replicas: one ``Replica`` (``replica``) per (model, version)
it holds, and everything that guards it (``Endpoint.replicas``). It is given at
construction what it needs: the endpoint's name (for messages), its tier, the
registration cache (``registrations``) and the regions the peer server serves
(``served``).

Protocol. Only ``add`` and ``drop`` change the table, each under its lock; the
callers are the caller's thread (publish, fetch, unpublish), the command workers
(retain, sync, discard) and, for its re-adopted copies, the agent's service thread.
The lock guards the table only (a replica's own fields, its chunks held and reads in
flight, are under ``Replica.lock``). Whatever walks the table does so under the lock
and hands out a snapshot (``all``, ``overlapping``, ``holdings``); a lookup (``get``,
``in``) is one dict read. Callers, per method (what they may do once it returns):

- ``register(...)``: a replica over ``placed``, its memory registered (or an idle
  registration reused). It is not in the table yet: the caller owns its registration
  until ``add`` returned (and gives it back itself if it fails before that).
- ``add(held)``: ``held`` is in the table and served. A version held already (two
  threads registering one version: a retain and a sync) raises ``EndpointError``
  naming it, with ``held``'s registration given back: nothing of ``held`` is left.
- ``drop(held, registration=...)``: ``held`` is out of the table and no longer served,
  every wait for its chunks answered (``Replica.gone``), and the scatters still reading
  its staging over; then its registration, by ``registration``: ``"give_back"``
  (default) back to the cache, kept registered for the next version in that memory;
  ``"drop"`` deregistered now, the memory is the caller's for good
  (``Endpoint.discard``); ``"keep"`` left alone, because zombies own it: a read given
  up may still write there (``zombies``).
- ``claim(key, deadline)``: while inside, no other fetch of this endpoint is between
  "is ``key`` held?" and holding it (claims are under a condition of their own).
- ``check_tier(placed, what)``: returns when ``placed`` lies in memory of our tier;
  else ``BadArgument`` naming ``what``, before anything was registered.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

from ..engines import wire
from ..engines.serve import Regions
from ..errors import BadArgument, EndpointError
from ..hub import protocol as p
from . import deltas, streams
from .registrations import Registrations
from .replica import Replica

Key = tuple[str, int]  # (model, version)


class Replicas:
    def __init__(self, name: str, tier: str, registrations: Registrations, served: Regions):
        self.name = name
        self.tier = tier
        self.registrations = registrations
        self.served = served
        self._table: dict[Key, Replica] = {}
        self._lock = threading.Lock()
        self._claims: set[Key] = set()  # versions a fetch is setting up (``claim``)
        self._claiming = threading.Condition()

    def get(self, key: Key) -> Optional[Replica]:
        """Our replica of ``key`` now, or None (it may be dropped right after: a replica
        let go says so, ``Replica.dropped``)."""
        return self._table.get(key)

    def __contains__(self, key: Key) -> bool:
        return key in self._table

    def __len__(self) -> int:
        return len(self._table)

    def all(self) -> list[Replica]:
        """The replicas now (the fetch loop, the command workers and the caller change
        them): a list of the caller's own."""
        with self._lock:
            return list(self._table.values())

    def holdings(self) -> dict[Key, p.Holding]:
        """Every replica's ``Replica.holding`` now, by key (a registration's holdings)."""
        with self._lock:
            return {h.key: h.holding() for h in self._table.values()}

    def filling(self) -> list[p.Filling]:
        """``Replica.filling`` of every replica a fetch is filling now (a beat's)."""
        return [f for h in self.all() if (f := h.filling()) is not None]

    def overlapping(self, regions) -> list[Replica]:
        """The replicas now whose memory overlaps ``regions``."""
        return [h for h in self.all() if h.overlaps(regions)]

    def held_chunk(self, model: str, version: int, chunk: int):
        """Chunk ``chunk`` (a global id) of ``model@version`` in our memory when we hold it
        whole and verified (a delta's base, ``scheduled``), else None."""
        held = self._table.get((model, version))
        if held is not None and held.rank >= 0 and held.world > 1:  # a shard: its chunks are not numbered globally
            return None
        return deltas.whole(held, chunk)

    def describe(self, ask: wire.Describe) -> wire.Described | wire.Refused:
        """The peer server's answer to ``ask``: how to read our replica of it (described
        by the engine that registered it), or ``not_found``."""
        held = self._table.get((ask.model, ask.version))
        if held is None:
            return wire.Refused(code="not_found", message=f"{self.name} holds no memory for {ask.model}@{ask.version}")
        return held.described(self.registrations.engine)

    def check_tier(self, placed, what: str) -> None:
        """The hub plans and retains by our tier: GPU tensors under a host tier (or the
        reverse) would be counted as the wrong copies. Nothing is registered yet."""
        if (placed.device >= 0) != (self.tier == "device"):
            where = f"cuda:{placed.device}" if placed.device >= 0 else "host memory"
            raise BadArgument(f"{what}: its tensors are in {where}, but {self.name} joined with tier "
                              f"{self.tier!r}; connect with device='{where if placed.device >= 0 else 'cpu'}'")

    def register(self, model: str, version: int, world: int, shards, rank: int, placed, owned=None,
                 fill: bool = False) -> Replica:
        """A replica over ``placed``, its memory registered (or a registration reused:
        ``registrations``; ``owned``: the caller's tensors, ``fill``: copy the layout's
        staging bytes over when reusing, see ``Registrations.acquire``)."""
        if (model, version) in self._table:
            raise EndpointError(f"{self.name} already holds {model}@{version}")
        reg = self.registrations.acquire(model, placed, owned, fill=fill)
        return Replica(model=model, version=version, world=world, shards=shards, rank=rank, placed=placed,
                       handle=reg.handle, reg=reg)

    def add(self, held: Replica) -> None:
        """``held`` is ours and served (see the module)."""
        with self._lock:
            if held.key in self._table:  # two threads registering one version (a retain and a sync)
                self.registrations.give_back(held.reg)
                raise EndpointError(f"{self.name} already holds {held.model}@{held.version}")
            self._table[held.key] = held
        self.served.add(id(held), held.placed.regions, owner=held.placed)

    def drop(self, held: Replica, *, registration: str = "give_back") -> None:
        """Let the replica go: no longer served; its registration given back (``give_back``) to the
        cache, ``drop``ped (deregistered now: the memory is the caller's for good), or
        ``keep``: zombies own it (``zombies``: reads may still write there)."""
        with self._lock:
            self._table.pop(held.key, None)
        held.gone()  # (an ``Await`` for its chunks is answered now: it would never be)
        self.served.remove(id(held))
        streams.passed(held.written)  # scatters still reading its staging end before it is reused or freed
        if registration == "drop":
            self.registrations.drop(held.reg)
        elif registration == "give_back":
            self.registrations.give_back(held.reg)

    @contextmanager
    def claim(self, key: Key, deadline: float) -> Iterator[None]:
        """One fetch of a version at a time between "is it held?" and holding it. Two
        fetches of one version (a retention pull and a `th sync`, on the agent's two
        workers) would otherwise both find it unheld, and the second to register would
        fail "already holds" though the first would have served it. A claim still held
        by another at ``deadline`` is an ``EndpointError``."""
        with self._claiming:
            if not self._claiming.wait_for(lambda: key not in self._claims,
                                           timeout=max(0.0, deadline - time.monotonic())):
                raise EndpointError(f"{self.name} is still setting up another fetch of {key[0]}@{key[1]}; "
                                    "gave up at the fetch's timeout")
            self._claims.add(key)
        try:
            yield
        finally:
            with self._claiming:
                self._claims.discard(key)
                self._claiming.notify_all()
