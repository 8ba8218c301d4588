"""The registration cache (``endpoint.registrations``) through the endpoint's own publish,
unpublish, fetch, release and close, with no hub: an engine that counts what it
registers, and a hub that says yes (and resolves to what was published)."""

from __future__ import annotations

import gc
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tensorhub_cli import BadArgument
from tensorhub_cli.endpoint import fetching, streams
from tensorhub_cli.endpoint.endpoint import Endpoint
from tensorhub_cli.endpoint.hub_sockets import HubSockets
from tensorhub_cli.endpoint.registrations import Registrations
from tensorhub_cli.endpoint.replicas import Replicas
from tensorhub_cli.endpoint.fetch import FetchError
from tensorhub_cli.endpoint.inflight import Zombie
from tensorhub_cli.endpoint.zombies import Zombies
from tensorhub_cli.engines.base import Engine, Region
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.layout import Placed, verify
from tensorhub_cli.layout.tensors import flat_bytes

SMALL = 1 << 10  # tensors below 1 KiB go to the publisher's staging buffer


class CountingEngine(Engine):
    """Registers nothing, but remembers every region set it was asked to, in order."""

    kind = "counting"

    def __init__(self, log: list | None = None):
        self.log = [] if log is None else log
        self.live: dict[int, tuple] = {}

    def register(self, regions):
        handle = object()
        self.live[id(handle)] = tuple(regions)
        self.log.append(("register", tuple(regions)))
        return handle

    def deregister(self, handle):
        self.log.append(("deregister", self.live.pop(id(handle))))

    def calls(self, kind: str) -> list:
        return [regions for what, regions, *_ in self.log if what == kind]

    def describe(self, handle):
        return b""

    def add_peer(self, address, description):
        raise NotImplementedError

    def read(self, peer, pairs, device=-1, remote_device=None):
        raise NotImplementedError

    def state(self, transfer):
        raise NotImplementedError

    def release(self, transfer):
        raise NotImplementedError


class Hub:
    """Answers publish/unpublish with Ok and resolves a version to its published manifest."""

    def __init__(self, log: list):
        self.log = log
        self.manifests: dict[tuple[str, int], p.Manifest] = {}

    def __call__(self, op, timeout):
        self.log.append(("hub", type(op).__name__))
        if isinstance(op, p.Publish):
            self.manifests[(op.model, op.version)] = op.manifest
        if isinstance(op, p.Resolve):
            shards = [self.manifests[op.model, op.version]]
            return p.Resolved(model=op.model, version=op.version, world=1, shards=shards)
        return p.Ok()


def bare_endpoint(engine: Engine, hub: Hub, cap: int | None = None) -> Endpoint:
    """An endpoint with no hub process and no threads: what publish, unpublish, fetch,
    release and close touch."""
    ep = Endpoint.__new__(Endpoint)
    ep.name, ep.incarnation, ep.chunk_bytes, ep.small_bytes = "e", "i1", 1 << 20, SMALL
    ep.info = p.EndpointInfo(name="e", node="n")  # a host tier: these tensors are host memory
    ep.read_timeout_s = ep.plan_timeout_s = ep.call_timeout_s = 5.0
    ep.drain_timeout_s = 5.0
    ep.service = SimpleNamespace(last_error=None)  # (the hub answers our beats)
    ep.served = Regions()
    ep.engine = ep.tcp = engine
    ep.call = hub
    if cap is not None:
        ep._registrations = Registrations(engine, cap)
    ep.replicas = Replicas(ep.name, ep.info.tier, ep.registrations, ep.served)  # (as ``Endpoint.__init__``)
    ep.zombies = Zombies("e", "i1", ep.replicas.get, 1.0, let_go=lambda reg: ep.registrations.give_back(reg))
    return ep


def close(ep: Endpoint) -> None:
    """``Endpoint.close(drain_timeout=0)`` with its threads stubbed out."""
    ep.service = SimpleNamespace(registered=threading.Event(), stop=lambda: None)
    ep.peer = SimpleNamespace(close=lambda: None)
    ep._sockets = HubSockets(lambda: None)  # (none made: ``call`` is the test's hub)
    ep.engine.close = lambda: None
    ep.verifiers = ThreadPoolExecutor(1)
    ep.close(drain_timeout=0)


class CopyFetch:
    """Stands in for the transfer loop: every chunk's bytes come from the publisher's
    memory (``source``), then a staged chunk is scattered and an event recorded after
    it, as ``Fetch._poll`` does (``test_stream_order`` checks that one)."""

    source: dict = {}

    def __init__(self, ep, held, deadline, window, **_):
        self.held, self.stats = held, {"bytes": 0}
        self.times = {"transfer_s": 0.0}  # (Fetch splits its loop time by stage)

    def run(self) -> None:
        views, placed = self.source[self.held.key], self.held.placed
        for c, view in enumerate(placed.views):
            view.copy_(views[c])
            placed.finish(c)
            if c in placed.scatter:
                self.held.written = streams.scattered(placed.device)
            self.held.held.add(c)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4096, generator=g), "b1": torch.randn(16, generator=g),
            "b2": torch.randn(8, generator=g)}


@pytest.fixture
def rig(monkeypatch):
    log: list = []
    engine, hub = CountingEngine(log), Hub(log)
    monkeypatch.setattr(fetching, "Fetch", CopyFetch)
    monkeypatch.setattr(fetching, "ScheduledFetch", CopyFetch)  # (the job class either way)
    CopyFetch.source = {}
    return engine, hub


def publish(ep: Endpoint, version: int, sd: dict, model: str = "m") -> p.Manifest:
    manifest = ep.publish(model, version, sd)
    CopyFetch.source[(model, version)] = ep.replicas.get((model, version)).placed.views
    return manifest


def test_a_second_publish_of_the_same_parameters_registers_nothing_new(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    sd = weights(1)
    publish(ep, 1, sd)
    ep.unpublish("m", 1)
    for t in sd.values():  # the optimizer step: in place
        t.mul_(-2).add_(1)
    v2 = publish(ep, 2, sd)
    assert len(engine.calls("register")) == 1 and not engine.calls("deregister")
    # What v2 serves is v2's bytes, small tensors included (copied into the staging
    # buffer the first version registered).
    held = ep.replicas.get(("m", 2))
    assert [held.placed.checksum(c) for c in range(len(v2.chunks))] == [c.checksum for c in v2.chunks]
    assert verify([v2], sd) == []
    assert {r.addr for r in held.placed.regions} == {r.addr for r in engine.calls("register")[0]}
    assert ep.served.contains(held.placed.regions[0].addr, 1)


def test_the_same_destination_fetched_twice_registers_once(rig):
    engine, hub = rig
    pub = bare_endpoint(CountingEngine(), hub)
    reader = bare_endpoint(engine, hub)
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    publish(pub, 1, weights(1))
    assert reader.fetch("m", 1, into=into) == 1
    publish(pub, 2, weights(2))
    assert reader.fetch("m", 2, into=into) == 2  # unpublishes 1 from these tensors first
    assert all(torch.equal(into[k], v) for k, v in weights(2).items())  # (through the reused staging buffer)
    assert len(engine.calls("register")) == 1 and not engine.calls("deregister")
    assert [h.version for h in reader.replicas.all()] == [2]
    other = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    reader.fetch("m", 1, into=other)  # other memory: registered anew; 2's stays in use
    assert len(engine.calls("register")) == 2 and all(torch.equal(other[k], v) for k, v in weights(1).items())


def test_close_deregisters_everything_used_or_idle(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    publish(ep, 1, weights(1))
    publish(ep, 1, weights(2), model="n")
    ep.unpublish("n", 1)  # idle
    assert len(engine.live) == 2
    close(ep)
    assert engine.live == {} and len(engine.calls("deregister")) == 2


def test_release_deregisters_at_once(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    publish(ep, 1, weights(1))
    ep.discard("m", 1)  # the hub forgot it: the memory is the caller's for good
    assert engine.live == {} and ep.registrations.idle() == []


def test_an_unused_registration_goes_at_the_next_version_that_does_not_reuse_it(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    publish(ep, 1, weights(1))
    ep.unpublish("m", 1)
    publish(ep, 1, weights(3), model="n")  # another model: m's stays
    assert len(engine.live) == 2
    publish(ep, 2, weights(2))  # m in other memory (a fresh copy per version)
    (gone,) = engine.calls("deregister")
    assert gone == engine.calls("register")[0] and len(engine.live) == 2


def test_idle_registrations_beyond_the_byte_cap_are_deregistered_oldest_first(rig):
    engine, hub = rig
    one = sum(t.nbytes for t in weights(1).values())
    ep = bare_endpoint(engine, hub, cap=one + 10)  # room for one idle set
    publish(ep, 1, weights(1), model="a")
    publish(ep, 1, weights(2), model="b")
    ep.unpublish("a", 1)
    assert not engine.calls("deregister")
    ep.unpublish("b", 1)
    assert engine.calls("deregister") == [engine.calls("register")[0]]  # a's, the older
    nothing = bare_endpoint(CountingEngine(), hub, cap=0)
    publish(nothing, 1, weights(1))
    nothing.unpublish("m", 1)
    assert nothing.engine.live == {}


def test_a_tensor_of_another_size_at_a_registered_address_is_registered_anew(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    base = torch.randn(8192)
    publish(ep, 1, {"w": base})
    ep.unpublish("m", 1)
    publish(ep, 1, {"w": base[:2048]}, model="n")  # same address, a quarter of the bytes
    (first, second) = engine.calls("register")
    assert first[0].addr == second[0].addr and (first[0].nbytes, second[0].nbytes) == (8192 * 4, 2048 * 4)
    # The old registration was let go before the overlapping one was made.
    assert [what for what, *_ in engine.log if what != "hub"] == ["register", "deregister", "register"]
    assert ep.replicas.get(("n", 1)).placed.regions[0].nbytes == 2048 * 4


def test_cached_memory_stays_allocated_until_deregistered(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    array = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    alive = weakref.ref(array)
    sd = {"w": torch.from_numpy(array)}
    del array
    publish(ep, 1, sd)
    ep.unpublish("m", 1)
    CopyFetch.source.clear()
    del sd
    gc.collect()
    assert alive() is not None, "memory still registered was freed"
    close(ep)
    gc.collect()
    assert alive() is None, "deregistered memory was kept alive"


def test_memory_resized_under_an_unused_registration_is_never_reused():
    """(Straight on the cache: on the host, hashing shares a tensor with numpy, which
    makes its storage fixed-size; FSDP resizes GPU parameters' storage to 0.)"""
    engine = CountingEngine()
    regs = Registrations(engine)
    t = torch.empty(0).resize_(4096).normal_()
    placed = Placed(views=[flat_bytes(t)], regions=[Region(t.data_ptr(), t.nbytes, -1)], keep=[t])
    regs.give_back(regs.acquire("m", placed, [t]))
    t.untyped_storage().resize_(0)
    u = torch.randn(100)
    regs.acquire("n", Placed(views=[flat_bytes(u)], regions=[Region(u.data_ptr(), u.nbytes, -1)], keep=[u]), [u])
    assert engine.calls("deregister") == [engine.calls("register")[0]] and regs.idle() == []


def test_reg_cache_bytes_must_be_a_byte_count():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(BadArgument, match="reg_cache_bytes"):
            Registrations(CountingEngine(), bad)


def test_every_version_of_the_in_place_loop_reuses_the_first_registration(rig):
    engine, hub = rig
    ep = bare_endpoint(engine, hub)
    sd = weights(1)
    for v in range(1, 6):
        manifest = publish(ep, v, sd)
        served = ep.replicas.get(("m", v)).placed
        assert [served.checksum(c) for c in range(len(manifest.chunks))] == [c.checksum for c in manifest.chunks]
        ep.unpublish("m", v)
        sd["b1"].add_(1)  # a small tensor changes each step: the staging buffer is refilled
    assert len(engine.calls("register")) == 1 and len(ep.registrations.idle()) == 1


class Stuck:
    """An engine whose given-up read is not over until the test says so (NIXL over UCX)."""

    def __init__(self):
        self.over = False

    def release(self, xfer) -> bool:
        return self.over


class GiveUpFetch(CopyFetch):
    """Copies half the chunks, then fails with one read its engine cannot confirm over."""

    engine: Stuck = Stuck()

    def run(self) -> None:
        raise FetchError("test: the holder stalled")

    def stop(self, timeout: float):
        h = self.held
        return [Zombie(self.engine, object(), h.model, h.version, p.Read(chunk=0, source="pub"), h.world,
                       tuple(h.shards))]

    def unpinned(self):
        return p.Progress(name="e", model=self.held.model, version=self.held.version, chunks=[], failed=[])


def test_a_destination_a_given_up_read_may_still_write_is_fenced_until_the_read_ends(rig, monkeypatch):
    """Scenario 2 of "no silent wrong bytes": a read of m@1 the engine could not stop
    must not share memory (or a registration) with the fetch of m@2 that comes next."""
    engine, hub = rig
    pub, reader = bare_endpoint(CountingEngine(), hub), bare_endpoint(engine, hub)
    publish(pub, 1, weights(1))
    publish(pub, 2, weights(2))
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    GiveUpFetch.engine = stuck = Stuck()
    monkeypatch.setattr(fetching, "Fetch", GiveUpFetch)
    monkeypatch.setattr(fetching, "ScheduledFetch", GiveUpFetch)  # (the job class either way)
    with pytest.raises(FetchError, match="stalled"):
        reader.fetch("m", 1, into=into, timeout=5)
    monkeypatch.setattr(fetching, "Fetch", CopyFetch)
    monkeypatch.setattr(fetching, "ScheduledFetch", CopyFetch)  # (the job class either way)
    with pytest.raises(FetchError, match="may still be written by 1 given-up read"):
        reader.fetch("m", 2, into=into, timeout=0.3)
    assert len(engine.calls("register")) == 1, "memory a read may still write was registered again"
    other = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    assert reader.fetch("m", 2, into=other) == 2  # other memory is not fenced
    stuck.over = True
    reader.zombies.reap(hub)
    assert reader.fetch("m", 1, into=into, timeout=5) == 1  # the read ended: the memory and its registration are free
    assert len(engine.calls("register")) == 2, "the fenced registration was not handed back for reuse"
    assert all(torch.equal(into[k], v) for k, v in weights(1).items())


def test_memory_freed_and_regrown_at_the_same_address_is_never_reused():
    """FSDP frees a parameter with ``storage.resize_(0)`` and regrows it before the
    next forward, often at the same address and size: a registration over the old
    allocation would serve freed pages (scenario 9 of "no silent wrong bytes")."""
    engine = CountingEngine()
    regs = Registrations(engine)
    t = torch.empty(1 << 18)
    storage = t.untyped_storage()

    def regrow() -> None:
        storage.resize_(0)
        storage.resize_(t.nbytes)

    for _ in range(5):  # (until the allocator hands the same block back each time, as glibc's mmap does)
        regrow()
    placed = Placed(views=[flat_bytes(t)], regions=[Region(t.data_ptr(), t.nbytes, -1)], keep=[t])
    regs.give_back(regs.acquire("m", placed, [t]))
    before = t.data_ptr()
    regrow()
    if t.data_ptr() != before:
        pytest.skip("the allocator did not regrow the storage at the same address")
    again = Placed(views=[flat_bytes(t)], regions=[Region(t.data_ptr(), t.nbytes, -1)], keep=[t])
    regs.acquire("m", again, [t])
    assert len(engine.calls("register")) == 2, "a registration over freed (then regrown) memory was reused"
    assert engine.calls("deregister") == [engine.calls("register")[0]]
