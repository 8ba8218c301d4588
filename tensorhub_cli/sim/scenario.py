"""Phases every workload is made of, each run to completion on a ``World``.

Protocol: ``register`` (endpoints join the hub), ``publish`` (trainer ranks publish
their shards of one version; returns when the last ``Publish`` is answered, i.e. the
version is READY), ``fetch`` (readers fetch one version, each from its own start time,
optionally only its tensor-parallel slice; returns every ``Fetch`` once all ended;
with ``groups``, the readers of one group share one resolve: ``SharedResolve``).
``manifests`` cuts a model of ``nbytes`` into ``world`` equal shards of chunks (one
tensor per chunk: the hub's per-tensor work is not what is measured here); ``slice_mask``
is the chunks TP rank ``k`` of ``tp`` reads (a contiguous 1/tp of the chunk ids).
"""

from __future__ import annotations

from ..hub import protocol as p
from .endpoint import Fetch, SimEndpoint
from .world import World


def manifests(nbytes: int, world: int, chunk_bytes: int) -> list[p.Manifest]:
    if nbytes < world:
        raise ValueError(f"a {nbytes}-byte model cannot be cut into {world} shards")
    out = []
    for rank in range(world):
        lo, hi = rank * nbytes // world, (rank + 1) * nbytes // world
        sizes = [min(chunk_bytes, hi - at) for at in range(lo, hi, chunk_bytes)]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        out.append(p.Manifest(
            tensors=[p.TensorMeta(name=f"s{rank}.w{i}", dtype="uint8", shape=[n], nbytes=n, offset=o)
                     for i, (n, o) in enumerate(zip(sizes, offsets))],
            chunks=[p.ChunkMeta(nbytes=n, checksum=i) for i, n in enumerate(sizes)], chunk_bytes=chunk_bytes))
    return out


def slice_mask(nchunks: int, k: int, tp: int) -> int:
    lo, hi = k * nchunks // tp, (k + 1) * nchunks // tp
    return ((1 << (hi - lo)) - 1) << lo


def register(world: World, eps: list[SimEndpoint]) -> None:
    left = {"n": len(eps)}

    def one() -> None:
        left["n"] -= 1

    for ep in eps:
        ep.register(one)
    world.run(lambda: left["n"] == 0, "registration")


def publish(world: World, trainers: list[SimEndpoint], model: str, version: int, shards: list[p.Manifest]) -> float:
    """Every rank publishes its shard at once; returns the time the last is answered."""
    left = {"n": len(trainers)}

    def one() -> None:
        left["n"] -= 1

    for rank, ep in enumerate(trainers):
        ep.publish(model, version, shards[rank], rank, len(trainers), one)
    world.run(lambda: left["n"] == 0, f"publishing {model}@{version}")
    return world.loop.now


class SharedResolve:
    """One ``Resolve`` for the members of a model-parallel instance, as the vLLM
    adapter's workers share rank 0's (``Endpoint.resolve``, the resolution broadcast
    over the engine's own group): the first member to start sends it, and every member
    gets the answer ``plan_rtt_s`` (the broadcast) after it came back, or after its own
    start if later."""

    def __init__(self, world: World, name: str, model: str, version: int):
        self.world, self.op = world, p.Resolve(name=name, model=model, version=version)
        self.body = None
        self.waiting: list = []

    def ask(self, reply) -> None:
        if self.body is not None:
            self.world.loop.after(self.world.fetch_params.plan_rtt_s, reply, self.body)
            return
        self.waiting.append(reply)
        if len(self.waiting) == 1:
            self.world.hub.call(self.op, self._answered)

    def _answered(self, body) -> None:
        self.body = body
        for reply in self.waiting:
            self.world.loop.after(self.world.fetch_params.plan_rtt_s, reply, body)
        self.waiting.clear()


def fetch(world: World, readers: list[tuple[SimEndpoint, int, float]], model: str, version: int,
          must_finish: bool = True, groups: dict[str, object] | None = None) -> dict[str, Fetch]:
    """``readers``: (endpoint, want mask or 0 for all, start time); ``groups``: endpoint
    name -> its group (those named share one resolve). Runs until every fetch ended:
    done, a hub error (raised unless ``must_finish`` is off), or its endpoint killed."""
    fetches: dict[str, Fetch] = {}
    open_ = {"n": len(readers)}
    shared: dict[object, SharedResolve] = {}

    def ended(f: Fetch, error: p.Error | None = None) -> None:
        open_["n"] -= 1

    def go(ep: SimEndpoint, want: int) -> None:
        if not ep.alive:  # died before its turn
            open_["n"] -= 1
            return
        g = (groups or {}).get(ep.name)
        if g is not None and g not in shared:
            shared[g] = SharedResolve(world, ep.name, model, version)
        fetches[ep.name] = ep.fetch(model, version, want=want, on_done=ended, on_error=ended,
                                    resolve=shared[g].ask if g is not None else None)

    for ep, want, at in readers:
        world.loop.at(at, go, ep, want)

    world.run(lambda: open_["n"] == 0, f"fetching {model}@{version}")
    if must_finish:
        failed = [f for f in fetches.values() if f.error is not None and f.error.code != "killed"]
        if failed:
            f = failed[0]
            raise RuntimeError(f"{len(failed)} fetch(es) failed, e.g. {f.ep.name}: {f.error.code}: {f.error.message}")
    return fetches
