"""One simulated cluster: the event loop, the network, the real hub on its simulated
core, and the endpoints; joins, leaves and failures are injected here.

Protocol: ``World(params, dcs, planner=...)`` builds the topology (``dcs``: GPUs per
datacenter) and a fresh ``hub.machine.Hub`` configured as the service would be
(``planner`` "ros", or "star" for the trainer-star baselines); ``fabric``, ``fetch``
and ``overhead_s`` replace the cluster's (the testbed's, for calibration), ``exact``
turns the network's rate quantum off. ``endpoint(name, gpu,
role)`` places an endpoint on a GPU (``register`` it to join); ``transfer`` moves one
chunk as a flow along the path between two GPUs (a delta instead, with ``deltas.enabled``:
below); ``leave(name)`` deregisters and
stops an endpoint; ``kill(name)`` is a node failure:
the endpoint stops (no heartbeats, no plans), its flows stop, a reader that was
reading from it sees that read fail after ``read_error_s``, and the hub expires it
after ``expiry_s`` through its sweep (contract 6), exactly as the service would.
``run(until_done)`` runs events until ``until_done()`` holds (or ``engine.limit_s``
simulated seconds pass: ``SimStuck``); heartbeats and sweeps stop with it.

Deltas (``params.deltas``; the real system serves none yet, this is what it will do):
a read of chunk c of version v+1 at one of ``deltas.levels`` (the path's level, as
``Topology.level`` names it), by a reader that holds c of v from a source that holds c
of v (readers: verified, ``holds``; a publisher: every version it published, one shard
shape for all), moves ``ratio`` x the chunk's bytes, and the reader hears of it with a
rebuild time (the chunk's bytes at ``rebuild_gbps``) its verifier spends before the
chunk counts. The hub is not told: it planned a full chunk and counts one.
``wire_bytes`` (per level) are the bytes flows actually moved, landed or stopped;
``delta_chunks`` how many reads were deltas; ``wan_readers`` who received across the WAN.
"""

from __future__ import annotations

import math
import random

from ..hub import protocol as p
from ..hub.machine import Hub, HubConfig
from ..hub.retention import Policy
from .endpoint import Fetch, SimEndpoint
from .events import Loop
from .hubserver import HubServer
from .network import Network
from .params import Fetch as FetchParams
from .params import SimParams
from .topology import Fabric, Topology


class SimStuck(RuntimeError):
    pass


class World:
    def __init__(self, params: SimParams, dcs: list[int], *, planner: str = "ros", fetch: FetchParams | None = None,
                 fabric: Fabric | None = None, overhead_s: float | None = None, exact: bool = False,
                 record: bool = False):
        h, e = params.hub, params.engine
        self.params = params
        self.fetch_params = fetch or params.fetch
        self.rng = random.Random(params.seed)
        self.loop = Loop()
        self.net = Network(self.loop, 0.0 if exact else e.quantum_s, 0.0 if exact else e.quantum_frac)
        self.topology = Topology(self.net, dcs, fabric or Fabric.of(params.cluster))
        hub = Hub(HubConfig(cluster="sim", expiry_s=h.expiry_s, grace_s=0.0, planner=planner,
                            max_reads_per_source=h.max_reads_per_source, muster_s=h.muster_s,
                            default_policy=Policy(keep_latest=2, min_reliable_copies=0)), now=0.0)
        self.hub = HubServer(self.loop, hub, rtt_s=self.fetch_params.plan_rtt_s, charge=h.charge_cpu,
                             cpu_scale=h.cpu_scale, overhead_s=h.request_overhead_s if overhead_s is None
                             else overhead_s, sweep_s=h.sweep_s, live=lambda name: self.endpoints[name].alive,
                             record=record, own_process=h.own_process and h.charge_cpu)
        self.endpoints: dict[str, SimEndpoint] = {}
        self.publishers: set[str] = set()
        self.running = True
        self._flows: dict[int, tuple[SimEndpoint, Fetch, int]] = {}  # fid -> (source, reader's fetch, chunk)
        self._by_endpoint: dict[str, set[int]] = {}
        self._wire: dict[int, tuple[str, int, float]] = {}  # fid -> (level, bytes on the wire, rebuild s)
        self.wire_bytes: dict[str, float] = {lv: 0.0 for lv in ("node", "rack", "dc", "remote")}
        self.delta_chunks = 0
        self.wan_readers: set[str] = set()  # readers a flow reached across the WAN (a workload may clear it)
        self._beating: list[SimEndpoint] = []
        self.chunk_sizes: dict[tuple, list[int]] = {}  # (model, version) -> bytes per chunk, from a Resolve
        # Scheduled readers (sim/reader.py): what each endpoint holds, and who waits for its notice.
        self._held: dict[tuple[str, tuple], int] = {}  # (endpoint, (model, version)) -> verified chunks
        self._waiters: dict[tuple[str, tuple], list[tuple[object, int, dict | None]]] = {}
        self._fragments: dict[tuple[str, tuple], dict[int, int]] = {}  # fragments: chunk -> bytes landed, unverified
        self.hub.start_sweeps()
        self.loop.after(h.heartbeat_s, self._beat)

    # --- endpoints --------------------------------------------------------------------
    def endpoint(self, name: str, gpu: int, role: str, reliable: bool = True) -> SimEndpoint:
        if name in self.endpoints:
            raise ValueError(f"endpoint {name!r} exists already")
        ep = self.endpoints[name] = SimEndpoint(self, name, self.topology.gpus[gpu], role, reliable)
        if role == "trainer":
            self.publishers.add(name)
        return ep

    def beating(self, ep: SimEndpoint) -> None:
        """``ep`` registered: it heartbeats from now on, while alive."""
        self._beating.append(ep)

    def _beat(self) -> None:
        if not self.running:
            return
        self._beating = [ep for ep in self._beating if ep.alive]
        # An endpoint whose plan the hub answered within the period skips this beat
        # (``endpoint.service``: the hub took the plan for one).
        recent = self.loop.now - self.params.hub.heartbeat_s
        self.hub.beats([ep.heartbeat() for ep in self._beating if ep.heard_at <= recent])
        self.loop.after(self.params.hub.heartbeat_s, self._beat)

    def expired_alive(self) -> int:
        """Endpoints the hub expired while they were alive and beating (contract 6 wants
        none: each loses its references and pins as if it had failed)."""
        return sum(1 for _, name in self.hub.expired if self.endpoints[name].alive)

    def is_publisher(self, name: str) -> bool:
        return name in self.publishers

    def leave(self, name: str) -> None:
        """An announced leave: ``name`` deregisters (the hub drops its references at
        once and re-plans the reads from it at each reader's next plan) and stops; no
        drain (contract 3's unpublish) is modelled."""
        self.hub.call(p.Deregister(name=name, incarnation=name), None)
        self.kill(name)

    def kill(self, name: str) -> None:
        """A failure: ``name`` stops at once, and its flows with it; readers waiting for
        its notices see their waits fail after ``read_error_s``."""
        ep = self.endpoints[name]
        ep.die()
        for (source, _), waiters in list(self._waiters.items()):
            if source == name:
                for fetch, *_ in waiters:
                    self.loop.after(self.fetch_params.read_error_s, fetch.await_failed, name)
                waiters.clear()
        for fid in list(self._by_endpoint.get(name, ())):
            src, fetch, chunk = self._flows[fid]
            self.stop_transfer(fid)
            if src is ep and fetch.ep.alive:
                self.loop.after(self.fetch_params.read_error_s, fetch.read_failed, chunk, src.name, fid)

    # --- notices (a holder tells a waiting reader it has a chunk now) --------------------
    def await_chunks(self, fetch, source: str, chunks: int, after: dict | None = None) -> None:
        """As ``wire.Await``: noticed once ``source`` holds one of ``chunks`` or, with
        ``after``, has landed more of one than ``after`` names."""
        src = self.endpoints.get(source)
        if src is None or not src.alive:
            self.loop.after(self.fetch_params.read_error_s, fetch.await_failed, source)
            return
        key = (source, fetch.key)
        have = chunks if source in self.publishers else self._held.get(key, 0) & chunks
        landed = self._landed_of(key, chunks & ~have, after)
        if have or any(n > after.get(c, 0) for c, n in landed.items()):
            self.loop.after(self.fetch_params.plan_rtt_s / 2, fetch.noticed, source, have, landed)
        else:
            self._waiters.setdefault(key, []).append((fetch, chunks, after))

    def _landed_of(self, key: tuple, chunks: int, after: dict | None) -> dict[int, int]:
        if after is None:
            return {}
        return {c: n for c, n in self._fragments.get(key, {}).items() if chunks >> c & 1}

    def holds(self, ep, version_key: tuple, chunk: int) -> None:
        """``ep`` verified ``chunk``: readers waiting for it hear so half a round trip later."""
        key = (ep.name, version_key)
        held = self._held[key] = self._held.get(key, 0) | 1 << chunk
        self._fragments.get(key, {}).pop(chunk, None)
        self._wake(key, held, lambda chunks, after: chunks >> chunk & 1)

    def relayed(self, ep, version_key: tuple, chunk: int, nbytes: int) -> None:
        """``ep`` has ``nbytes`` of ``chunk`` landed, unverified (0: its read starts over):
        readers waiting for its fragments hear so half a round trip later."""
        key = (ep.name, version_key)
        if not nbytes:
            self._fragments.get(key, {}).pop(chunk, None)
            return
        self._fragments.setdefault(key, {})[chunk] = nbytes
        self._wake(key, self._held.get(key, 0), lambda chunks, after: after is not None and chunks >> chunk & 1
                   and nbytes > after.get(chunk, 0))

    def _wake(self, key: tuple, held: int, ends) -> None:
        waiters = self._waiters.get(key)
        if not waiters:
            return
        keep = []
        for fetch, chunks, after in waiters:
            if ends(chunks, after):
                have = chunks & held
                self.loop.after(self.fetch_params.plan_rtt_s / 2, fetch.noticed, key[0], have,
                                self._landed_of(key, chunks & ~have, after))
            else:
                keep.append((fetch, chunks, after))
        self._waiters[key] = keep

    # --- bytes --------------------------------------------------------------------------
    def transfer(self, src: SimEndpoint, fetch: Fetch, chunk: int, nbytes: int, fragment: bool = False) -> int:
        """A flow of ``chunk`` (``fragment``: ``nbytes`` of it, never a delta) from ``src`` to ``fetch``."""
        level = self.topology.level(src.gpu, fetch.ep.gpu)
        rebuild_s = 0.0
        if not fragment and self._delta(src, fetch, chunk, level):
            d = self.params.deltas
            rebuild_s = nbytes * 8 / (d.rebuild_gbps * 1e9)
            nbytes = max(1, math.ceil(nbytes * d.ratio))
            self.delta_chunks += 1
        path = self.topology.path(src.gpu, fetch.ep.gpu)
        fid = self.net.start(path, nbytes, lambda: self._landed(fid))
        self._flows[fid] = (src, fetch, chunk)
        self._wire[fid] = (level, nbytes, rebuild_s)
        self._by_endpoint.setdefault(src.name, set()).add(fid)
        self._by_endpoint.setdefault(fetch.ep.name, set()).add(fid)
        return fid

    def sends_delta(self, source: str, fetch, chunk: int) -> bool:
        """A read of ``chunk`` from ``source`` would go as a delta (``transfer``)."""
        src = self.endpoints.get(source)
        return src is not None and self._delta(src, fetch, chunk, self.topology.level(src.gpu, fetch.ep.gpu))

    def _delta(self, src: SimEndpoint, fetch, chunk: int, level: str) -> bool:
        d = self.params.deltas
        if not d.enabled or level not in d.levels or fetch.version < 2:
            return False
        old = (fetch.model, fetch.version - 1)
        return self.has(fetch.ep, old, chunk) and self.has(src, old, chunk)

    def has(self, ep: SimEndpoint, version_key: tuple, chunk: int) -> bool:
        """``ep`` holds ``chunk`` of that version: verified by its fetch, or published."""
        return version_key in ep.published or bool(self._held.get((ep.name, version_key), 0) >> chunk & 1)

    def _landed(self, fid: int) -> None:
        src, fetch, chunk = self._untrack(fid)
        level, nbytes, rebuild_s = self._wire.pop(fid)
        self.wire_bytes[level] += nbytes
        if level == "remote":
            self.wan_readers.add(fetch.ep.name)
        fetch.landed(chunk, fid, rebuild_s)

    def stop_transfer(self, fid: int) -> None:
        if fid in self._flows:
            self._untrack(fid)
            level, _, _ = self._wire.pop(fid)
            self.wire_bytes[level] += self.net.stop(fid)

    def _untrack(self, fid: int):
        src, fetch, chunk = self._flows.pop(fid)
        self._by_endpoint[src.name].discard(fid)
        self._by_endpoint[fetch.ep.name].discard(fid)
        return src, fetch, chunk

    # --- time ---------------------------------------------------------------------------
    def run(self, until_done, what: str = "the scenario") -> None:
        limit = self.loop.now + self.params.engine.limit_s
        self.loop.run(until=limit, stop=until_done)
        if not until_done():
            self.running = False
            raise SimStuck(f"{what} did not finish within {self.params.engine.limit_s:g} simulated seconds")

    def close(self) -> None:
        """Stop heartbeats and sweeps (their events fall through) and end the hub's
        process, if it has one (``hub.counters`` still reads its last counters)."""
        self.running = False
        self.hub.stop_sweeps()
        self.hub.close()
