"""The hub's state machine: pure, no sockets, time injected.

Protocol: every operation is a method ``op(now, msg)`` returning a reply body, or
``None`` for an unpublish whose acknowledgement is deferred, or raising ``HubFault``
with the state unchanged. ``expire(now)`` must be called periodically. Deferred
acknowledgements (``Acked``) and hub → agent commands (``Send``) are queued; take them
with ``take_outbound()`` after each call and deliver them.

State is soft (contract 7): it can be rebuilt entirely from endpoints re-registering
what they hold and what they are reading. For ``grace_s`` after start no unpublish is
acknowledged, so that every live reader has re-registered its in-flight reads (its
pins) before a drain can be judged complete.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from ..planner import Candidate, Place, choose, groups, level_between
from ..planner.plan import LEVELS
from . import protocol as p
from .asking import Asking
from .commands import Commands
from .groups import Round, round_over
from .registry import READY, UNAVAILABLE, Replica, Version
from .retention import Policy, pulls_needed, retained, short


_LEVEL_KEYS = [f"bytes_planned.level.{name}" for name in LEVELS]
_TIER_KEYS = {tier: f"bytes_planned.tier.{tier}" for tier in ("device", "host")}
# A trainer's send counter, split by its readers' kind: spot joiners should read ~0 of it.
_FROM_PUBLISHERS = {True: "bytes_planned.from_publishers.reliable", False: "bytes_planned.from_publishers.spot"}


class HubFault(Exception):
    """An operation refused; the state is unchanged."""

    def __init__(self, code: str, message: str, missing: list[int] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.missing = missing or []

    def as_error(self) -> p.Error:
        return p.Error(code=self.code, message=self.message, missing=self.missing[:1000])


@dataclass(frozen=True)
class Acked:
    """An unpublish is answered: drained (ok), or its endpoint was dropped meanwhile."""

    endpoint: str
    model: str
    version: int
    ok: bool = True


@dataclass(frozen=True)
class Send:
    endpoint: str
    body: p.Command


@dataclass
class Endpoint:
    info: p.EndpointInfo
    last_seen: float
    place: Place = field(init=False)
    bytes_planned: int = 0  # reads planned for it (as a reader), all versions
    bytes_from_publishers: int = 0  # of those, served by publishers

    def __post_init__(self) -> None:
        self.place = Place(node=self.info.node, rack=self.info.rack, dc=self.info.dc)

    @property
    def name(self) -> str:
        return self.info.name


@dataclass
class HubConfig:
    cluster: str = "tensorhub"
    expiry_s: float = 5.0
    round_timeout_s: float = 120.0
    grace_s: float | None = None  # default: expiry_s
    planner: str = "ros"  # "ros", or "star": every read from a publisher (benchmark baseline)
    policies: dict[str, Policy] = field(default_factory=dict)
    default_policy: Policy = Policy()
    max_window: int = 1024
    # ROS planner: reads one source serves at once (all versions) once more than one
    # reader uses it. A source that splits its link over many readers finishes every
    # chunk late, and so delays the relaying that makes fan-out flat; readers it turns
    # away read from peers. A source with one reader is not capped: its window rules.
    # With k readers asking a publisher, each may hold cap // k of its reads (at least
    # one), so the reader whose report comes with its next plan cannot take every
    # freed read.
    max_reads_per_source: int = 4


class Hub(Commands):
    def __init__(self, config: HubConfig, now: float = 0.0):
        self.config = config
        self.started_at = now
        self.grace_until = now + (config.expiry_s if config.grace_s is None else config.grace_s)
        self.endpoints: dict[str, Endpoint] = {}
        self.models: dict[str, dict[int, Version]] = {}
        self.rounds: dict[tuple[str, str], Round] = {}
        self.load: dict[str, int] = {}  # reads in flight per source, all versions
        # Sources at max_reads_per_source: a plan skips them in C (set difference), not
        # one by one, so a reader whose rack is busy walks its DC in microseconds.
        self.full: set[str] = set()
        self.asking = Asking()  # which readers asked which source lately (fair shares)
        self.near: dict[tuple, set[str]] = {}  # topology group (node, rack, dc) -> endpoint names
        self.counters: dict[str, float] = {}
        self._outbound: list[Acked | Send] = []
        # after a restart: rebuilt reads whose source has not re-registered yet
        self._unplaced: dict[str, list[tuple[Version, str]]] = {}
        self._init_events()

    # --- small helpers ---------------------------------------------------------------

    def count(self, key: str, n: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def take_outbound(self) -> list[Acked | Send]:
        out, self._outbound = self._outbound, []
        return out

    def policy(self, model: str) -> Policy:
        return self.config.policies.get(model, self.config.default_policy)

    def _endpoint(self, name: str) -> Endpoint:
        ep = self.endpoints.get(name)
        if ep is None:
            # After a hub restart every endpoint lands here once, and re-registers.
            raise HubFault("unknown_endpoint", f"endpoint {name!r} is not registered")
        return ep

    def _version(self, model: str, number: int) -> Version:
        v = self.models.get(model, {}).get(number)
        if v is None:
            raise HubFault("not_found", f"{model}@{number} is not known to the hub")
        return v

    def _alive(self, now: float, name: str) -> bool:
        ep = self.endpoints.get(name)
        return ep is not None and now - ep.last_seen <= self.config.expiry_s

    def _reliable(self, name: str) -> bool:
        ep = self.endpoints.get(name)
        return ep is not None and ep.info.reliable

    def _pin(self, v: Version, reader: str, chunk: int, source: str) -> None:
        v.pin(reader, chunk, source)
        load = self.load[source] = self.load.get(source, 0) + 1
        if load >= self.config.max_reads_per_source:
            self.full.add(source)

    def _unpin(self, v: Version, reader: str, chunk: int) -> None:
        source = v.unpin(reader, chunk)
        if source is not None:
            left = self.load[source] - 1
            if left < self.config.max_reads_per_source:
                self.full.discard(source)
            if left:
                self.load[source] = left
            else:
                del self.load[source]

    # --- endpoints -------------------------------------------------------------------

    def register(self, now: float, op: p.Register) -> p.Ok:
        old = self.endpoints.get(op.info.name)
        if old is not None and old.info.pid != op.info.pid and self._alive(now, old.name):
            # Two live processes under one name would corrupt every reference it owns.
            raise HubFault("conflict", f"endpoint name {op.info.name!r} is held by a live endpoint (pid {old.info.pid})")
        if old is not None:
            self._drop_endpoint(now, old.name)
        ep = self.endpoints[op.info.name] = Endpoint(info=op.info, last_seen=now)
        _join(self.near, ep.place, ep.name)
        self.count("registrations")
        for holding in op.holdings:
            try:
                self._restore(now, op.info.name, holding)
            except HubFault:
                self.count("errors.holding")  # one stale holding must not cost the others
        for v, reader in self._unplaced.pop(op.info.name, []):
            if reader in self.endpoints and op.info.name in v.reads.get(reader, {}).values():
                self._note_seed(v, reader, op.info.name)
        self._settle(now)
        return p.Ok()

    def heartbeat(self, now: float, op: p.Heartbeat) -> p.Ok:
        self._endpoint(op.name).last_seen = now
        return p.Ok()

    def deregister(self, now: float, op: p.Deregister) -> p.Ok:
        self._endpoint(op.name)
        self._drop_endpoint(now, op.name)
        self._settle(now)
        return p.Ok()

    def expire(self, now: float) -> list[str]:
        dead = [n for n in self.endpoints if not self._alive(now, n)]
        for name in dead:
            self._drop_endpoint(now, name)
            self.count("expiries")
            self.event(now, "expired", name)
        if dead:
            self._settle(now)
        return dead

    def _drop_endpoint(self, now: float, name: str) -> None:
        """Contract 6: a gone endpoint loses every reference, pin and read it had."""
        ep = self.endpoints.pop(name, None)
        self.asking.forget(name)
        if ep is not None:
            _leave(self.near, ep.place, name)
        for versions in self.models.values():
            for v in versions.values():
                for chunk in list(v.reads.get(name, {})):
                    self._unpin(v, name, chunk)
                for reader in [r for r, reads in v.reads.items() if name in reads.values()]:
                    for chunk in [c for c, s in v.reads[reader].items() if s == name]:
                        self._unpin(v, reader, chunk)
                if name in v.replicas:
                    self._forget_replica(v, name, ep.place if ep is not None else None)
                if name in v.draining:
                    v.draining.discard(name)
                    self._outbound.append(Acked(endpoint=name, model=v.model, version=v.number, ok=False))
                v.pulls.discard(name)
                v.avoid.pop(name, None)
                for dc in [dc for dc, seed in v.seeds.items() if seed == name]:
                    del v.seeds[dc]
                v.refresh()
            for number in [n for n, v in versions.items() if not v.replicas and not v.ever_ready]:
                del versions[number]  # a STAGING version whose publishers are all gone

    # --- publish ---------------------------------------------------------------------

    def publish(self, now: float, op: p.Publish) -> p.Ok:
        self._endpoint(op.name)
        known = self.models.get(op.model, {}).get(op.version)
        was = known.state if known else None
        v = self._add_shard(op.name, op.model, op.version, op.rank, op.world, op.manifest)
        self.count("publishes")
        if v.state == READY and was != READY:
            self.event(now, "ready", op.name, op.model, op.version)
        self._settle(now)
        return p.Ok()

    def _add_shard(self, name: str, model: str, number: int, rank: int, world: int, manifest: p.Manifest) -> Version:
        check_manifest(manifest, number, rank, world)
        digest = p.manifest_digest(1, [manifest])
        versions = self.models.setdefault(model, {})
        v = versions.get(number)
        if v is None:
            v = versions[number] = Version(model=model, number=number, world=world)
        elif v.world != world:
            raise HubFault("conflict", f"{model}@{number} was published with world {v.world}, not {world}")
        elif rank in v.shard_digests and v.shard_digests[rank] != digest:
            raise HubFault("conflict", f"{model}@{number} shard {rank} exists with a different manifest")
        rep = v.replicas.get(name)
        if rep is not None and rep.rank != rank:
            raise HubFault("conflict", f"{name} already holds {model}@{number} as {'reader' if rep.rank < 0 else f'shard {rep.rank}'}")
        v.shards[rank], v.shard_digests[rank] = manifest, digest
        if rep is None:
            rep = v.replicas[name] = Replica(endpoint=name, rank=rank)
            v.publishers.add(name)
        self._assemble(v)
        if v.assembled:
            rep.held |= v.shard_mask(rank)
            self._index(v, name)
        if v.refresh() == READY:
            self._drop_old(model)
        return v

    def _assemble(self, v: Version) -> None:
        """Assembly gives every publisher its shard's chunks at once: index them all."""
        if not v.assembled:
            v.assemble()
            for name, rep in v.replicas.items():
                if rep.held:
                    self._index(v, name)

    def _index(self, v: Version, name: str) -> None:
        _join(v.near, self.endpoints[name].place, name)

    def _forget_replica(self, v: Version, name: str, place: Place | None) -> None:
        """``name``'s replica of ``v`` is gone: so is it from every index over replicas."""
        del v.replicas[name]
        v.publishers.discard(name)
        v.respread()
        if place is not None:
            _leave(v.near, place, name)

    def _restore(self, now: float, name: str, h: p.Holding) -> None:
        if h.rank >= 0:
            self._add_shard(name, h.model, h.version, h.rank, h.world, h.shards[0])
            return
        if len(h.shards) != h.world:
            raise HubFault("malformed", "a reader's holding must carry every shard's manifest")
        digests = []
        for rank, m in enumerate(h.shards):
            check_manifest(m, h.version, rank, h.world)
            digests.append(p.manifest_digest(1, [m]))
        versions = self.models.setdefault(h.model, {})
        v = versions.get(h.version)
        if v is not None and (v.world != h.world or any(
                v.shard_digests.get(r, d) != d for r, d in enumerate(digests))):
            raise HubFault("conflict", f"{h.model}@{h.version}: holding does not match the known manifest")
        if v is None:
            v = versions[h.version] = Version(model=h.model, number=h.version, world=h.world)
        for rank, m in enumerate(h.shards):  # a reader knows every shard, even those whose publisher is gone
            v.shards.setdefault(rank, m)
            v.shard_digests.setdefault(rank, digests[rank])
        self._assemble(v)
        v.ever_ready = True  # readers only ever read READY versions: a gap now means UNAVAILABLE
        held = 0
        for c in h.held:
            if 0 <= c < v.nchunks:
                held |= 1 << c
        rep = v.replicas.setdefault(name, Replica(endpoint=name))
        rep.held |= held
        v.respread(held, self.endpoints[name].place.dc)
        if held:
            self._index(v, name)
        for r in h.reading:
            # Pin even a source that has not re-registered yet: if it is alive and
            # unpublishes, this read in flight must still hold its drain back.
            if 0 <= r.chunk < v.nchunks and not held >> r.chunk & 1 and r.source != name:
                self._pin(v, name, r.chunk, r.source)
                if r.source in self.endpoints:
                    self._note_seed(v, name, r.source)
                else:  # its DC is known once it re-registers
                    self._unplaced.setdefault(r.source, []).append((v, name))
        if v.refresh() == READY:
            self._drop_old(h.model)

    def _note_seed(self, v: Version, reader: str, source: str) -> None:
        """A rebuilt read across a DC link makes its reader that DC's seed again."""
        dc = self.endpoints[reader].place.dc
        if self.endpoints[source].place.dc != dc:
            v.seeds.setdefault(dc, reader)

    # --- resolve ---------------------------------------------------------------------

    def resolve(self, now: float, op: p.Resolve) -> p.Resolved:
        self._endpoint(op.name)
        versions = self.models.get(op.model)
        if not versions:
            raise HubFault("not_found", f"model {op.model!r} has no versions")
        if op.version is not None:
            v = self._version(op.model, op.version)
            self._require_ready(v)
            return self._resolved(v, 0)
        if op.group is None:
            return self._resolved(self._latest(op.model), 0)
        key = (op.model, op.group)
        rnd = self.rounds.get(key)
        if rnd is not None:
            members = {n for n, ep in self.endpoints.items() if ep.info.group == op.group}
            v_round = self.models[op.model].get(rnd.version)
            why = round_over(rnd, members, now, self.config.round_timeout_s, lambda n: n in self.endpoints,
                             lambda n: v_round is not None and v_round.complete(n))
            if why is not None or v_round is None:
                self.count(f"rounds_ended.{(why or 'version dropped').replace(' ', '_')}")
                rnd = None
        if rnd is None:
            latest = self._latest(op.model)
            number = self.rounds[key].number + 1 if key in self.rounds else 1
            rnd = self.rounds[key] = Round(number=number, version=latest.number, opened_at=now)
        v = self.models[op.model][rnd.version]
        self._require_ready(v)
        rnd.resolved.add(op.name)
        return self._resolved(v, rnd.number)

    def _latest(self, model: str) -> Version:
        ready = [v for v in self.models.get(model, {}).values() if v.state == READY]
        if not ready:
            raise HubFault("not_found", f"model {model!r} has no READY version")
        return max(ready, key=lambda v: v.number)

    @staticmethod
    def _require_ready(v: Version) -> None:
        if v.state == UNAVAILABLE:
            missing = v.missing()
            raise HubFault("unavailable", f"{v.model}@{v.number} is UNAVAILABLE: no live endpoint holds "
                           f"{len(missing)} chunk(s), e.g. {missing[:8]}", missing)
        if v.state != READY:
            raise HubFault("not_ready", f"{v.model}@{v.number} is {v.state}")

    @staticmethod
    def _resolved(v: Version, rnd: int) -> p.Resolved:
        return p.Resolved(model=v.model, version=v.number, world=v.world, shards=v.manifests(), round=rnd)

    # --- plan / progress / cancel ----------------------------------------------------

    def plan(self, now: float, op: p.Plan) -> p.Planned:
        reader = self._endpoint(op.name)
        if op.chunks or op.failed:
            self.progress(now, p.Progress(name=op.name, model=op.model, version=op.version, chunks=op.chunks,
                                          failed=op.failed))
        v = self._version(op.model, op.version)
        self._require_ready(v)
        if op.name in v.draining:
            # Its buffer is being let go: reads into it would be lost, and their pins
            # would outlive the replica they were filling.
            raise HubFault("draining", f"{op.name} is unpublishing {v.model}@{v.number}; "
                                       "it cannot fetch that version until the unpublish is acknowledged")
        rep = v.replicas.get(op.name)
        if rep is None:  # a reader is a (partial) holder from its first plan on
            rep = v.replicas[op.name] = Replica(endpoint=op.name)
        if rep.held == v.full:
            return p.Planned(reads=[], sources=[], complete=True)
        self._drop_lost_reads(now, v, op.name)
        reads = v.reads.get(op.name, {})
        assigned = 0
        for chunk in reads:
            assigned |= 1 << chunk
        window = max(1, min(op.window, self.config.max_window))
        needed = v.full & ~rep.held & ~assigned
        may_cross = self._may_cross(v, reader)
        busy_held = [0]  # needed chunks only busy holders have: filled by _levels, level by level
        result = choose(
            needed=needed,
            start=zlib.crc32(op.name.encode()) % v.nchunks,
            limit=window - len(reads),
            levels=self._levels(now, v, reader, needed, busy_held, may_cross),
            may_cross=may_cross,
            deferred=lambda want: busy_held[0] | self._full_held(now, v, reader, want & ~busy_held[0]),
        )
        planned: dict[str, int] = {}  # counter -> bytes, summed here so each counter is touched once
        relayed = 0  # reads served by readers, not publishers: pipelined replication at work
        for chunk, source, level in result.assigned:
            self._pin(v, op.name, chunk, source)
            nbytes = v.chunk_nbytes[chunk]
            reader.bytes_planned += nbytes
            if v.replicas[source].rank >= 0:
                self.asking.note(source, op.name, now)
                reader.bytes_from_publishers += nbytes
                tier = _FROM_PUBLISHERS[reader.info.reliable]
                planned[tier] = planned.get(tier, 0) + nbytes
            else:
                relayed += 1
            for key in (_LEVEL_KEYS[level], _TIER_KEYS[self.endpoints[source].info.tier]):
                planned[key] = planned.get(key, 0) + nbytes
        for key, nbytes in planned.items():
            self.count(key, nbytes)
        if relayed:
            self.count("reads_from_readers", relayed)
        if result.crossed:
            v.seeds[reader.place.dc] = op.name
        self.count("plans")
        # Reads restored after a hub restart whose source has not re-registered stay
        # pinned but unlisted: the reader finishes or fails them on its own.
        reads = {c: s for c, s in v.reads.get(op.name, {}).items() if s in self.endpoints}
        names = set(reads.values())
        return p.Planned(
            reads=[p.Read(chunk=c, source=s) for c, s in sorted(reads.items())],
            sources=[self._source(n) for n in sorted(names)],
            waiting=result.waiting,
        )

    def _drop_lost_reads(self, now: float, v: Version, reader: str) -> None:
        """Contract 6: reads onto a source past its expiry (swept or not) are re-planned
        at once. A source that has not re-registered since a hub restart counts as lost
        only after the grace period."""
        for chunk, source in list(v.reads.get(reader, {}).items()):
            if source in self.endpoints:
                lost = not self._alive(now, source)
            else:
                lost = now >= self.grace_until
            if lost:
                self._unpin(v, reader, chunk)

    @staticmethod
    def _may_cross(v: Version, reader: Endpoint) -> bool:
        """Contract 8: one reader per DC (the seed) pulls across at a time. A seed with
        no read in flight (done, stopped, cancelled) or that let its replica go hands
        the role on, so a stalled seed never blocks its DC."""
        seed = v.seeds.get(reader.place.dc)
        if seed is None or seed == reader.name:
            return True
        if seed not in v.replicas or seed in v.draining or not v.reads.get(seed):
            del v.seeds[reader.place.dc]
            return True
        return False

    def _levels(self, now: float, v: Version, reader: Endpoint, needed: int, busy_held: list[int],
                may_cross: bool):
        """Candidates for ``reader`` one topology level at a time, each built only when
        the planner asks for it. Levels 0–2 walk the version's holders in the reader's
        node, rack and DC (``Version.near``), so a plan does not scan the cluster; a
        holder of nothing the reader ``needed`` is no candidate at all."""
        star = self.config.planner == "star"
        retention_pull = reader.name in v.pulls
        avoid = v.avoid.get(reader.name, ())
        here = reader.place
        keys = groups(here)
        replicas, endpoints, load = v.replicas, self.endpoints, self.load
        expiry, me, cap = self.config.expiry_s, reader.name, self.config.max_reads_per_source
        asking, spread = self.asking, v.spread
        mine: dict[str, int] = {}  # this reader's own reads in flight, per source
        for source in v.reads.get(me, {}).values():
            mine[source] = mine.get(source, 0) + 1
        # Draining replicas take no new reads, except the retention copy of themselves.
        closed = () if retention_pull else v.draining
        full = self.full
        if not star:  # a reader turned away by a full publisher still asked for it
            for name in v.publishers & full:
                if replicas[name].held & needed:
                    asking.note(name, me, now)

        def gather(n: int, names):
            """The eligible holders among ``names``, all at level n. (The hot loop of
            a plan: locals bound above, cheapest tests first.)"""
            for name in names:
                rep = replicas.get(name)
                if rep is None or not rep.held & needed or name == me or name in closed:
                    continue
                if star and rep.rank < 0:
                    continue
                ep = endpoints.get(name)
                if ep is None or now - ep.last_seen > expiry:
                    continue
                busy = load.get(name, 0)
                if star:
                    # Topology ignored for the choice; the true level still goes
                    # into the counters, so bytes_planned.level.* compare with ours.
                    yield Candidate(name, rep.held, level_between(here, ep.place), busy, name in avoid)
                    continue
                held = rep.held
                if rep.rank >= 0 and not avoid:
                    # A publisher sends into a DC only chunks no reader there has
                    # yet: readers relay the rest (never fetched across a DC instead),
                    # so its link carries one copy. A reader that met a bad holder
                    # may have any chunk from it again (contract 5).
                    relayed = spread.get(here.dc)
                    if relayed is None:
                        relayed = self._spread(v, here.dc)
                    busy_held[0] |= held & relayed & needed
                    held &= ~relayed
                    if not held & needed:
                        continue
                # Fair shares only at publishers: they are few (so this stays cheap
                # with thousands of relays) and they are where readers queue.
                others = asking.others(name, me, now) if rep.rank >= 0 else 0
                room = 1 << 30  # a source nobody else asks for: the reader's window decides
                if others or busy > mine.get(name, 0):
                    room = min(cap - busy, max(1, cap // (1 + others)) - mine.get(name, 0))
                    if room <= 0:
                        busy_held[0] |= held & needed
                        if rep.rank >= 0:
                            asking.note(name, me, now)
                        continue
                # A chunk this source is already sending to another reader will be
                # at that reader soon: fetch it from there, so it leaves here once.
                if name in v.serving:
                    sending = v.serving_mask(name)
                    busy_held[0] |= held & sending & needed
                    held &= ~sending
                if held & needed:
                    yield Candidate(name, held, n, busy, name in avoid, rep.rank >= 0, room)

        if star:  # the baseline: publishers only, topology ignored
            yield 0, gather(0, replicas)
            return
        # Holders come from the version's index; what is cut out as a cheaper level
        # comes from where endpoints are, which the index cannot get wrong. (Set
        # difference runs in C: a DC of holders costs microseconds, not a Python loop.)
        # Full sources turn every reader away: skipped here, their chunks in _full_held.
        inner: set[str] = set()
        for n, key in enumerate(keys):
            yield n, gather(n, v.near.get(key, set()) - inner - full)
            inner = self.near.get(key, set())
        if may_cross:  # else the planner stops before this level: skip the set difference
            yield len(keys), gather(len(keys), replicas.keys() - inner - full)

    def _full_held(self, now: float, v: Version, reader: Endpoint, want: int) -> int:
        """Chunks of ``want`` that full sources in ``reader``'s DC hold: they wait for
        those sources rather than cross a DC link. Asked only when a plan reaches that
        level."""
        out = 0
        closed = () if reader.name in v.pulls else v.draining
        for name in self.full & v.near.get(("dc", reader.place.dc), set()):
            rep = v.replicas.get(name)
            if rep is not None and rep.held & want and name not in closed and self._alive(now, name):
                out |= rep.held & want
                if out == want:
                    break
        return out

    def _spread(self, v: Version, dc: str) -> int:
        """``v.spread[dc]``, computed from the DC's holder index."""
        out = 0
        for name in v.near.get(("dc", dc), ()):
            rep = v.replicas.get(name)
            if rep is not None and rep.rank < 0 and name not in v.draining:
                out |= rep.held
        v.spread[dc] = out
        return out

    def _source(self, name: str) -> p.Source:
        info = self.endpoints[name].info
        return p.Source(name=name, node=info.node, engine=info.engine, engine_meta=info.engine_meta)

    def progress(self, now: float, op: p.Progress) -> p.Ok:
        self._endpoint(op.name)
        v = self._version(op.model, op.version)
        if not v.assembled:
            raise HubFault("not_ready", f"{v.model}@{v.number} is {v.state}")
        bad = [c for c in op.chunks if not 0 <= c < v.nchunks]
        if bad:
            raise HubFault("malformed", f"chunk ids out of range 0..{v.nchunks - 1}: {bad[:8]}")
        rep = v.replicas.setdefault(op.name, Replica(endpoint=op.name))
        for c in op.chunks:
            rep.held |= 1 << c
            self._unpin(v, op.name, c)
        if op.chunks:
            if rep.rank < 0:
                v.respread(rep.held, self.endpoints[op.name].place.dc)
            if rep.held == v.full:
                self.asking.done(op.name)
            self._index(v, op.name)
        for r in op.failed:  # contract 5: a corrupt or failed read is re-planned elsewhere
            if v.reads.get(op.name, {}).get(r.chunk) == r.source:
                self._unpin(v, op.name, r.chunk)
                v.avoid.setdefault(op.name, set()).add(r.source)
                self.count("reads_failed")
        self.count("chunks_reported", len(op.chunks))
        was = v.state
        if was != READY and v.refresh() == READY:  # adding chunks cannot uncover a READY version
            self.event(now, "ready", op.name, v.model, v.number)
            self._drop_old(v.model)
            self._settle(now)
        elif v.pulls or v.draining:
            self._settle(now, v)
        return p.Ok()

    def cancel(self, now: float, op: p.Cancel) -> p.Ok:
        """The reader gave up its reads in flight (a fetch timed out or was aborted)."""
        self._endpoint(op.name)
        v = self._version(op.model, op.version)
        for chunk in list(v.reads.get(op.name, {})):
            self._unpin(v, op.name, chunk)
        self.asking.done(op.name)
        self._settle(now)
        return p.Ok()

    # --- unpublish, retention, drop --------------------------------------------------

    def unpublish(self, now: float, op: p.Unpublish) -> None:
        """Deferred: an ``Acked`` is queued once the replica's pins reach zero (and any
        retention copy it called for is complete)."""
        self._endpoint(op.name)
        v = self._version(op.model, op.version)
        rep = v.replicas.get(op.name)
        if rep is None:
            raise HubFault("not_found", f"{op.name} holds no replica of {op.model}@{op.version}")
        v.draining.add(op.name)  # contract 3: no new reads from here on
        v.respread()
        v.pulls.discard(op.name)  # a retention copy it was making is abandoned with it
        self.count("unpublishes")
        self._settle(now, v)
        return None

    def _settle(self, now: float, only: Version | None = None) -> None:
        """Start the retention pulls now needed; acknowledge every drain now complete.

        ``only``: the one version an operation touched (the hot path: progress). When a
        drain empties a version and it is forgotten, an older version may move up into
        keep_latest, and its drains must then wait for copies. So versions are judged
        newest first, and a model that lost one is judged again from the top before any
        older version of it is acknowledged. (Terminates: each extra pass follows a
        version being dropped.)"""
        todo = [only] if only else [v for vs in self.models.values() for v in vs.values()]
        while todo:
            moved = self._settle_pass(now, todo)
            todo = [v for m in sorted(moved) for v in self.models.get(m, {}).values()]

    def _settle_pass(self, now: float, todo: list[Version]) -> set[str]:
        todo = sorted(todo, key=lambda v: (v.model, -v.number))
        keeps: dict[str, set[int]] = {}
        moved: set[str] = set()  # models that lost a version in this pass
        for v in todo:
            versions = self.models[v.model]
            if v.number not in versions or v.model in moved:
                continue  # its older versions: judged in the next pass, with the new keep set
            policy = self.policy(v.model)
            if v.model not in keeps:
                keeps[v.model] = set(retained(versions, policy))
            kept = v.number in keeps[v.model]
            if kept:
                self._start_pulls(now, v, policy)
            for name in sorted(v.draining):
                if self._drained(now, v, name, kept, policy):
                    v.draining.discard(name)
                    self._forget_replica(v, name, self.endpoints[name].place)
                    self._outbound.append(Acked(endpoint=name, model=v.model, version=v.number))
                    self.count("unpublish_acks")
                    self.event(now, "unpublished", name, v.model, v.number)
                    if not v.replicas:  # its holders let it go: forget it
                        del versions[v.number]
                        self.count("versions_dropped")
                        moved.add(v.model)
                        break
            else:
                v.refresh()
        return moved

    def settle(self, now: float) -> None:
        """Re-judge every drain and retention; the service calls this on its sweep,
        because some of it turns on time alone (the grace period, agents expiring)."""
        self._settle(now)

    def _drained(self, now: float, v: Version, name: str, is_retained: bool, policy: Policy) -> bool:
        if v.pins.get(name, 0) or now < self.grace_until:
            return False
        if not is_retained or v.state != READY or not short(v, policy, self._reliable):
            return True  # (not READY: no complete copy can be made, so none is waited for)
        # Short: wait for a pull under way; give up only when no agent can make a copy.
        pulling = any(self._alive(now, a) and not v.complete(a) for a in v.pulls)
        return not pulling and not self._pull_candidates(now, v)

    def _pull_candidates(self, now: float, v: Version) -> list[str]:
        agents = [ep for ep in self.endpoints.values()
                  # an agent letting its own replica go cannot be the one to keep a copy
                  if ep.info.kind == "agent" and self._alive(now, ep.name) and ep.name not in v.pulls
                  and ep.name not in v.draining and not v.complete(ep.name)]
        agents.sort(key=lambda ep: (not ep.info.reliable, self.load.get(ep.name, 0), ep.name))
        return [ep.name for ep in agents]

    def _start_pulls(self, now: float, v: Version, policy: Policy) -> None:
        if v.state != READY:
            return  # nothing complete to copy from
        need = pulls_needed(v, policy, self._reliable)
        for agent in self._pull_candidates(now, v)[:need]:
            v.pulls.add(agent)
            self._outbound.append(Send(endpoint=agent, body=p.Command(action="retain", model=v.model, version=v.number)))
            self.count("retention_pulls")

    def _drop_old(self, model: str) -> None:
        """Once READY versions fall out of keep_latest, forget those nobody is reading."""
        versions = self.models[model]
        keep = set(retained(versions, self.policy(model)))
        in_rounds = {r.version for (m, _), r in self.rounds.items() if m == model}
        newest = max(keep) if keep else 0
        for number in [n for n, v in versions.items() if v.ever_ready and n not in keep and n < newest]:
            v = versions[number]
            if not v.pins and number not in in_rounds and not v.draining:
                del versions[number]
                self.count("versions_dropped")
                # Agents hold retention copies nobody will unpublish: tell them to let go,
                # or every version ever retained would stay in their host memory.
                for name in sorted(v.replicas):
                    ep = self.endpoints.get(name)
                    if ep is not None and ep.info.kind == "agent":
                        self._outbound.append(Send(endpoint=name, body=p.Command(
                            action="release", model=model, version=number)))

    # --- views -----------------------------------------------------------------------

    def versions(self, now: float, op: p.Versions) -> p.VersionsReply:
        models = [op.model] if op.model else sorted(self.models)
        if op.model and op.model not in self.models:
            raise HubFault("not_found", f"model {op.model!r} has no versions")
        return p.VersionsReply(versions=[v.status(self._reliable) for m in models
                                         for _, v in sorted(self.models[m].items())])

    def status(self, now: float) -> p.StatusReply:
        held: dict[str, int] = {}
        for versions in self.models.values():
            for v in versions.values():
                for name in v.replicas:
                    held[name] = held.get(name, 0) + 1
        eps = [
            p.EndpointStatus(name=ep.name, node=ep.info.node, role=ep.info.role, kind=ep.info.kind,
                             alive=self._alive(now, ep.name), heartbeat_age_s=round(now - ep.last_seen, 3),
                             replicas=held.get(ep.name, 0), rack=ep.info.rack, dc=ep.info.dc,
                             reliable=ep.info.reliable, bytes_planned=ep.bytes_planned,
                             bytes_from_publishers=ep.bytes_from_publishers)
            for ep in sorted(self.endpoints.values(), key=lambda e: e.name)
        ]
        return p.StatusReply(cluster=self.config.cluster, uptime_s=round(now - self.started_at, 3), endpoints=eps,
                             versions=self.versions(now, p.Versions()).versions, counters=dict(self.counters),
                             events=list(self.events)[-50:])


def _join(index: dict[tuple, set[str]], place: Place, name: str) -> None:
    """Add ``name`` to each topology group of ``place`` in ``index``."""
    for key in groups(place):
        index.setdefault(key, set()).add(name)


def _leave(index: dict[tuple, set[str]], place: Place, name: str) -> None:
    for key in groups(place):
        members = index.get(key)
        if members is not None:
            members.discard(name)
            if not members:
                del index[key]


def check_manifest(m: p.Manifest, number: int, rank: int, world: int) -> None:
    if number < 1:
        raise HubFault("malformed", f"version must be >= 1, got {number}")
    if not 0 <= rank < world:
        raise HubFault("malformed", f"shard rank {rank} outside world {world}")
    if not m.chunks:
        raise HubFault("malformed", "a manifest needs at least one chunk")
    if m.chunk_bytes <= 0 or any(not 0 < c.nbytes <= m.chunk_bytes for c in m.chunks):
        raise HubFault("malformed", f"chunk sizes must be in 1..chunk_bytes ({m.chunk_bytes})")
    total = sum(c.nbytes for c in m.chunks)
    for t in m.tensors:
        if t.offset < 0 or t.nbytes < 0 or t.offset + t.nbytes > total:
            raise HubFault("malformed", f"tensor {t.name!r} lies outside the {total} bytes its chunks cover")
