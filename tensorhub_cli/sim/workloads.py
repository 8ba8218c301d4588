"""The paper's three workloads and their baselines, on simulated clusters.

Every decision is the real hub's (``World`` runs ``hub.machine.Hub`` with the ROS
planner for ours, the "star" planner for the trainer-star baselines); only bytes and
time are simulated. Trainer ranks (the first GPUs) publish one version of the model,
sharded over all of them; a rollout instance is ``rollout_tp`` consecutive GPUs and
rank k of an instance reads slice k (1/tp of the chunks, ``scenario.slice_mask``);
where too few rollout GPUs make the instances a workload needs, tp is smaller
(``tp_of``, reported as ``tp``). An instance's ranks resolve once between them
(``fetch.group_resolve``: ``scenario.SharedResolve``), as the vLLM adapter's do.

- ``standalone``: every rollout fetches the new version at once (instances start
  within ``start_jitter_s``); an instance stalls from its start until its last rank
  holds its slice. Baseline (veRL's global weight-transfer stage, as ``th bench rl``
  runs it): every byte from the trainer (star) and every GPU, trainer's included, waits
  until the last rollout holds the version. Stall is GPU-seconds, trainer included
  (ours: the trainer stalls only for its ``Publish`` round trip).
- ``elastic``: standing rollouts hold the version; ``joiner_fraction`` of the rollout
  GPUs (whole instances) join at once and fetch it. Update time: from their joining
  (``Register``) until the last joiner holds its slice. Baseline: joiners read point
  to point from the trainer (star).
- ``cross_dc``: the trainer and part of the rollouts in dc1, ``remote_fraction`` of
  the rollouts in dc2 behind the WAN; all fetch at once. Stall: GPU-seconds of the
  remote rollouts. Baseline: every remote rollout pulls across the WAN (star).
- ``cross_dc_versions``: cross_dc over two versions: v1 published and fetched by every
  rollout, then v2; only the v2 round is measured (its stalls, ``version_s``, hub bytes
  by level, ``wan_bytes``: what the WAN carried, ``wan_readers``: how many readers it
  carried it to). With ``deltas.enabled`` its
  crossing reads move deltas against v1 (``World``, "Deltas"); the hub plans as ever.

Each returns plain numbers: the time until every reader holds the version
(``version_s``), when the last reader had its first plan answered (``start_burst_s``),
stalls, the hub's CPU in the real state machine during the version (``hub_cpu_s``, per
op kind in ``hub_cpu``), and its byte counters by level.
"""

from __future__ import annotations

import math

from . import scenario as sc
from .params import SimParams
from .world import World

MODEL = "policy"
LEVELS = ("node", "rack", "dc", "remote")


def split(params: SimParams, gpus: int) -> tuple[int, int]:
    """(trainer GPUs, rollout GPUs) of ``gpus`` in all."""
    trainer = max(1, round(gpus * params.roles.trainer_fraction))
    if trainer >= gpus:
        raise ValueError(f"--gpus {gpus}: too few GPUs for a trainer and a rollout")
    return trainer, gpus - trainer


def tp_of(params: SimParams, rollouts: int, instances: int) -> int:
    """``roles.rollout_tp``, or less where the rollout GPUs would not make ``instances``
    instances of it (a small ``--gpus``)."""
    return max(1, min(params.roles.rollout_tp, rollouts // instances))


class Cast:
    """A world's trainer ranks and rollout GPUs, placed and registered."""

    def __init__(self, world: World, trainer: int, rollouts: list[tuple[int, int]], tp: int):
        """``rollouts``: (GPU index, rollout number) per rollout GPU."""
        self.world, self.tp = world, tp
        # ``roles.export`` "gathered": one rank per trainer node sends (its node's
        # shards); the other trainer GPUs still stall with it.
        per = world.params.cluster.gpus_per_node if world.params.roles.export == "gathered" else 1
        senders = max(1, trainer // per)
        self.trainer = [world.endpoint(f"trainer-{r}", r * (trainer // senders), "trainer") for r in range(senders)]
        self.rollouts = [world.endpoint(f"rollout-{i}", gpu, "rollout") for gpu, i in rollouts]
        self.number = {ep.name: i for (_, i), ep in zip(rollouts, self.rollouts)}
        m = world.params.model
        self.shards = sc.manifests(m.nbytes, senders, m.chunk_bytes)
        self.nchunks = sum(len(s.chunks) for s in self.shards)

    def want(self, ep) -> int:
        return sc.slice_mask(self.nchunks, self.number[ep.name] % self.tp, self.tp)

    def instance(self, ep) -> int:
        return self.number[ep.name] // self.tp


def _world(params: SimParams, dcs: list[int], planner: str, record: bool = False) -> World:
    """Ours reads as ``fetch.protocol`` says (a schedule by default, as endpoints do);
    the trainer-star baselines keep the windowed reader they were always simulated with
    (docs/design.md, "Schedules"): only ours changes between protocols."""
    if planner == "star":
        return World(params, dcs, planner=planner, fetch=params.fetch.model_copy(update={"protocol": "window"}),
                     record=record)
    return World(params, dcs, planner=planner, record=record)


def _levels(world: World) -> dict[str, int]:
    c = world.hub.counters
    return {lv: int(c.get(f"bytes_planned.level.{lv}", 0)) for lv in LEVELS}


def _fetch_round(cast: Cast, eps, t0: float, jitter: bool, version: int = 1) -> tuple[dict, dict[int, float], tuple]:
    """Fetch the version on ``eps`` (instances start within the jitter when ``jitter``);
    → (fetches, instance → start, the hub's ``mark`` from before the fetch)."""
    world = cast.world
    spread = world.fetch_params.start_jitter_s if jitter else 0.0
    starts = {}
    for ep in eps:
        i = cast.instance(ep)
        if i not in starts:
            starts[i] = t0 + world.rng.uniform(0.0, spread)
    mark = world.hub.mark()
    groups = {ep.name: cast.instance(ep) for ep in eps} if world.fetch_params.group_resolve else None
    fetches = sc.fetch(world, [(ep, cast.want(ep), starts[cast.instance(ep)]) for ep in eps], MODEL, version,
                       groups=groups)
    return fetches, starts, mark


def _instance_stall(cast: Cast, fetches, starts) -> tuple[float, list[float]]:
    """GPU-seconds: each instance's GPUs stall from its start until its last rank is done."""
    done: dict[int, float] = {}
    gpus: dict[int, int] = {}
    for name, f in fetches.items():
        i = cast.instance(f.ep)
        done[i] = max(done.get(i, 0.0), f.ended)
        gpus[i] = gpus.get(i, 0) + 1
    per = [done[i] - starts[i] for i in sorted(done)]
    return sum(gpus[i] * (done[i] - starts[i]) for i in done), per


def _summary(world: World, fetches, t0: float, mark: tuple) -> dict:
    """The version's figures; the hub's CPU, busy time and calls are those after ``mark``
    (taken as the version's fetch began: registration and publishing left out)."""
    ends = [f.ended for f in fetches.values()]
    planned = [f.planned_at for f in fetches.values() if f.planned_at is not None]
    cpu, busy, calls = world.hub.since(mark)
    return {
        "version_s": max(ends) - t0,
        # when the last reader heard its first plan: no reader can end before that plus
        # its own bytes at its NIC's rate, so a hub slow through the start burst shows here
        "start_burst_s": max(planned, default=t0) - t0,
        "hub_cpu_s": cpu,
        "hub_cpu_total_s": world.hub.cpu_s,  # setup included: the wall time the real hub took
        "hub_cpu": {k: round(v, 4) for k, v in sorted(world.hub.cpu.items())},
        "hub_calls": calls,
        "hub_counters": world.hub.counters,
        "hub_busy_s": busy,
        "hub_max_queue": world.hub.max_queue,
        "expired_alive": world.expired_alive(),
        "silence_max_s": world.hub.silence_max_s,
        "bytes_by_level": _levels(world),
        "from_trainer_bytes": sum(f.from_publishers for f in fetches.values()),
        "bytes": sum(f.bytes for f in fetches.values()),
        "max_reader_bytes": max((f.bytes for f in fetches.values()), default=0),
        "events": world.loop.events,
        "rate_recomputes": world.net.recomputes,
    }


def standalone(params: SimParams, planner: str, trainer: int, rollouts: int, barrier: bool,
               record: bool = False) -> dict:
    """``record``: the result's ``hub_log`` is the hub's calls (``sim.alone``)."""
    world = _world(params, [trainer + rollouts], planner, record)
    cast = Cast(world, trainer, [(trainer + i, i) for i in range(rollouts)], tp_of(params, rollouts, 1))
    sc.register(world, cast.trainer + cast.rollouts)
    began = world.loop.now
    t0 = sc.publish(world, cast.trainer, MODEL, 1, cast.shards)
    publish_s = t0 - began
    fetches, starts, mark = _fetch_round(cast, cast.rollouts, t0, jitter=not barrier)
    world.close()
    out = _summary(world, fetches, t0, mark)
    if record:
        out["hub_log"] = world.hub.log(mark)
    if barrier:  # the global stage: every GPU waits for the last rollout
        rollout_stall = rollouts * out["version_s"]
        trainer_stall = trainer * (publish_s + out["version_s"])
    else:
        rollout_stall, _ = _instance_stall(cast, fetches, starts)
        trainer_stall = trainer * publish_s
    return {**out, "planner": planner, "trainer_gpus": trainer, "rollout_gpus": rollouts, "tp": cast.tp,
            "publish_s": publish_s, "rollout_stall_s": rollout_stall, "trainer_stall_s": trainer_stall,
            "stall_s": rollout_stall + trainer_stall}


def elastic(params: SimParams, planner: str, trainer: int, rollouts: int) -> dict:
    tp = tp_of(params, rollouts, 2)
    instances = math.ceil(rollouts / tp)
    if instances < 2:
        raise ValueError(f"elastic: {rollouts} rollout GPU(s) cannot be a standing and a joining instance")
    joining = min(instances - 1, max(1, round(instances * params.workloads.elastic.joiner_fraction)))
    first_joiner = (instances - joining) * tp
    world = _world(params, [trainer + rollouts], planner)
    cast = Cast(world, trainer, [(trainer + i, i) for i in range(rollouts)], tp)
    standing, joiners = cast.rollouts[:first_joiner], cast.rollouts[first_joiner:]
    sc.register(world, cast.trainer + standing)
    t0 = sc.publish(world, cast.trainer, MODEL, 1, cast.shards)
    _fetch_round(cast, standing, t0, jitter=True)  # they hold it before anyone joins
    t_join = world.loop.now
    mark = world.hub.mark()  # (the joiners' registration is part of their update)
    sc.register(world, joiners)
    fetches, _, _ = _fetch_round(cast, joiners, world.loop.now, jitter=False)
    world.close()
    out = _summary(world, fetches, t_join, mark)
    return {**out, "planner": planner, "trainer_gpus": trainer, "tp": tp, "standing_gpus": len(standing),
            "joiner_gpus": len(joiners), "update_s": out["version_s"]}


def _two_dcs(params: SimParams, planner: str, trainer: int, rollouts: int):
    """cross_dc's world: the trainer and the first rollout instances in dc1, ``remote_fraction``
    of them in dc2; every endpoint registered. → (world, cast, local GPUs, remote GPUs)."""
    tp = tp_of(params, rollouts, 2)
    instances = math.ceil(rollouts / tp)
    remote_inst = min(instances, max(1, round(instances * params.workloads.cross_dc.remote_fraction)))
    local = min(rollouts, (instances - remote_inst) * tp)
    world = _world(params, [trainer + local, rollouts - local], planner)
    cast = Cast(world, trainer, [(trainer + i, i) for i in range(rollouts)], tp)
    sc.register(world, cast.trainer + cast.rollouts)
    return world, cast, local, rollouts - local


def _cross_dc_round(cast: Cast, planner: str, version: int, local: int, remote: int) -> dict:
    """Publish ``version`` and fetch it on every rollout; → the round's figures (hub bytes
    by level and ``wan_bytes`` counted over this round only)."""
    world = cast.world
    levels, wan = _levels(world), world.wire_bytes["remote"]
    world.wan_readers.clear()
    began = world.loop.now
    t0 = sc.publish(world, cast.trainer, MODEL, version, cast.shards)
    fetches, starts, mark = _fetch_round(cast, cast.rollouts, t0, jitter=True, version=version)
    out = _summary(world, fetches, t0, mark)
    out["bytes_by_level"] = {lv: n - levels[lv] for lv, n in out["bytes_by_level"].items()}
    far = {n: f for n, f in fetches.items() if f.ep.gpu.dc != "dc1"}
    near = {n: f for n, f in fetches.items() if f.ep.gpu.dc == "dc1"}
    remote_stall, _ = _instance_stall(cast, far, starts)
    local_stall, _ = _instance_stall(cast, near, starts) if near else (0.0, [])
    version_bytes = world.params.model.nbytes
    return {**out, "planner": planner, "trainer_gpus": len(cast.trainer), "tp": cast.tp, "local_gpus": local,
            "remote_gpus": remote, "publish_s": t0 - began, "remote_stall_s": remote_stall,
            "local_stall_s": local_stall, "remote_version_s": max(f.ended for f in far.values()) - t0,
            "wan_copies": round(out["bytes_by_level"]["remote"] / version_bytes, 3),
            "wan_bytes": world.wire_bytes["remote"] - wan, "wan_readers": len(world.wan_readers)}


def cross_dc(params: SimParams, planner: str, trainer: int, rollouts: int) -> dict:
    world, cast, local, remote = _two_dcs(params, planner, trainer, rollouts)
    out = _cross_dc_round(cast, planner, 1, local, remote)
    world.close()
    return out


def cross_dc_versions(params: SimParams, planner: str, trainer: int, rollouts: int) -> dict:
    """v1 everywhere first (its round is not measured), then v2's round: its figures, with
    ``delta_chunks`` (reads sent as deltas) and ``deltas`` (whether they were on)."""
    world, cast, local, remote = _two_dcs(params, planner, trainer, rollouts)
    _cross_dc_round(cast, planner, 1, local, remote)
    sent = world.delta_chunks
    out = _cross_dc_round(cast, planner, 2, local, remote)
    world.close()
    return {**out, "deltas": params.deltas.enabled, "delta_chunks": world.delta_chunks - sent}
