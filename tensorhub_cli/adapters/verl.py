"""verl's checkpoint engine ``"tensorhub"``: each trainer step is a TensorHub version.

Protocol. verl (0.9.1) picks it with ``rollout.checkpoint_engine.backend=tensorhub`` and
``rollout.checkpoint_engine.custom_backend_module=tensorhub_cli.adapters.verl``: every
worker imports this module, which registers ``TensorHubCheckpointEngine`` in verl's
``CheckpointEngineRegistry``, and verl builds it with ``bucket_size=``, on trainer
ranks ``is_master=`` (torch rank 0), and ``checkpoint_engine.engine_kwargs.tensorhub``:
``cluster`` (a ``th up`` cluster; ``node`` defaults to $TH_NODE, else the host name;
inside a Ray worker of a ``launcher: ray`` cluster both may be left out: the cluster
and the node of the Ray node we run on are found through Ray) or ``hub`` + ``token_file``; ``model`` ("policy"), ``engine`` ("nixl"/"tcp"),
``device`` ("cpu"; "cuda" is the worker's current GPU), ``host`` (hub mode: the address
we serve from, default $TH_HOST or 127.0.0.1), ``name``, ``group`` (rollout side: see
Groups), ``reliable``, ``chunk_bytes``, ``double_buffer`` (rollout side, default false:
see ``receive_weights``; the trainer always double-buffers), and the seconds
``publish_timeout_s`` (60), ``drain_timeout_s`` (120), ``receive_timeout_s`` (600). A
bad option raises ``BadArgument`` naming it at construction; the hub is joined at the
first send or receive.

Versions. verl's step s is TensorHub version **s + 1** (on both sides): a PPO run's
first sync is ``update_weights(global_steps=0)`` (the weights it starts from, before
step 1), and TensorHub versions start at 1. A run resumed at step k syncs k (version
k + 1) and goes on from k + 1, so versions only increase within a run and stay >= 1;
``global_steps=None`` means one above our newest (sender) or ``latest`` (receiver).

Groups (contract 2). The rollout workers of one replica (its TP/PP ranks, one
``CheckpointEngineWorker`` each) connect with one TensorHub group, so a ``latest``
they resolve is one version for all of them (the endpoint resolves every fetch with
its group). ``group`` names it; by default it is the replica's verl worker group:
``verl-<Ray job id>-<$WG_PREFIX>`` (verl gives each standalone or colocated replica's
workers their own prefix, ``rollout_standalone_<replica>``; a hybrid engine's workers
share one, which makes one group of the whole run: coarser, still one version).
Outside a verl worker ($WG_PREFIX unset) there is no default group. The trainer joins
no group: it publishes, and a member that never fetches would hold rounds open.

- ``send_weights(weights, global_steps)`` (trainer): the master rank copies the
  (name, tensor) stream into one of TWO buffer sets and publishes it as version
  ``global_steps + 1`` (None: one above our last). The sets alternate: version v stays
  published (readable) while v+1 is written into the other set; before a set is
  written, the version it held is unpublished, which returns once no read of it is in
  flight (contract 3). So the trainer holds at most two versions, and 2x the model in
  buffers. Other ranks consume the stream (it may run collectives) and publish
  nothing. A step equal to the newest one published (verl re-syncs a step with no
  training between, e.g. after validation) is compared, not republished: different
  bytes raise ``EndpointError``. A lower step raises ``BadArgument``. Returns the
  metrics dict verl merges into the trainer's (``checkpoint_engine/*``).
- ``receive_weights(global_steps)`` (rollout): fetches version ``global_steps + 1``
  (None: ``latest``, resolved with the endpoint's group: see Groups above),
  waiting up to ``receive_timeout_s`` (then ``VersionTimeout``), into a staging set
  kept across steps, then yields (name, tensor) views of it. Those tensors are now
  published (this rollout serves them to others): the consumer copies them and must
  not change them. By default there is one staging set, so the endpoint unpublishes
  (drains) version v the moment the fetch of v+1 starts writing over it. With
  ``double_buffer`` two sets alternate: v+1 lands in the set v does not occupy, so v
  stays published (joiners read it from rollouts, not the trainer) while v+1 is
  fetched and loaded, and goes only when v+2 needs its set; at most two versions held,
  2x the model in staging. A version still held is yielded again without a fetch. A
  set is made at its first use and made again only when the tensors' names, shapes or
  dtypes change, after unpublishing what it held. ``last_receive`` holds the
  endpoint's fetch stages (``last_fetch``).
- ``prepare``/``build_topology``/``init_process_group``: TensorHub needs no process
  group (readers find holders through the hub), so they return ``{}``/``({}, {})``
  and do nothing.
- ``finalize`` (after every sync) frees nothing: the published buffers are the source
  other rollouts read. A set is reused by a later step (trainer: two steps later;
  rollout: the next step, or two later with ``double_buffer``); every buffer goes at
  ``close()`` (which drains readers first) or at process exit.

Importing this module without verl raises ``ImportError`` naming how to install it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

try:
    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
    from verl.workers.rollout.utils import ensure_async_iterator
except ImportError as exc:
    raise ImportError(
        f"tensorhub_cli.adapters.verl needs verl ({exc}): install it with `pip install --no-deps verl==0.9.1` "
        "and then `pip install -r requirements/verl.txt` (see that file for why --no-deps)") from exc

import torch

from ..api import connect
from ..errors import BadArgument, EndpointError
from ..layout import allocate
from ..names import check_model

log = logging.getLogger("tensorhub.verl")
_WHERE = "checkpoint_engine.engine_kwargs.tensorhub"


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BadArgument(f"{_WHERE}.{what} takes seconds > 0, not {value!r}")
    return float(value)


def _device(value: object) -> torch.device:
    try:
        dev = torch.device(value)
    except (TypeError, RuntimeError):
        raise BadArgument(f"{_WHERE}.device takes 'cpu', 'cuda' or 'cuda:N', not {value!r}") from None
    if dev.type == "cuda" and dev.index is None:  # (the worker's GPU, as verl sets it per process)
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise BadArgument(f"{_WHERE}.device takes 'cpu', 'cuda' or 'cuda:N', not {value!r}")
    return dev


@dataclass
class _Set:
    """One trainer buffer set: the tensors, and the version they hold published."""
    tensors: dict = field(default_factory=dict)
    version: Optional[int] = None


@CheckpointEngineRegistry.register("tensorhub")
class TensorHubCheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int = 0, is_master: bool = False, *, cluster: Optional[str] = None,
                 hub: Optional[str] = None, token_file: Optional[str] = None, model: str = "policy",
                 node: Optional[str] = None, engine: Optional[str] = None, device: str = "cpu",
                 host: Optional[str] = None, name: Optional[str] = None, group: Optional[str] = None,
                 reliable: Optional[bool] = None, chunk_bytes: Optional[int] = None,
                 double_buffer: bool = False, publish_timeout_s: float = 60.0, drain_timeout_s: float = 120.0,
                 receive_timeout_s: float = 600.0):
        # bucket_size is verl's transfer bucket: TensorHub cuts its own chunks (chunk_bytes).
        from ..launch.ray_lookup import in_ray

        inside_ray = in_ray()  # a Ray worker finds its cluster and node itself (connect)
        if (cluster is not None and hub is not None) or (cluster is None and hub is None and not inside_ray):
            raise BadArgument(f"{_WHERE} needs exactly one of cluster=NAME or hub=ADDRESS (+ token_file); "
                              "inside a Ray worker of a `launcher: ray` cluster, neither")
        if hub is not None and not (isinstance(token_file, str) and Path(token_file).is_file()):
            raise BadArgument(f"{_WHERE}.token_file must name a readable file with hub=..., not {token_file!r}")
        if engine not in (None, "nixl", "tcp"):
            raise BadArgument(f"{_WHERE}.engine takes 'nixl' or 'tcp', not {engine!r}")
        if reliable not in (None, True, False):
            raise BadArgument(f"{_WHERE}.reliable takes true or false, not {reliable!r}")
        if not isinstance(double_buffer, bool):  # (not `in (True, False)`: 1 == True, and "yes" is no bool)
            raise BadArgument(f"{_WHERE}.double_buffer takes true or false, not {double_buffer!r}")
        self.bucket_size, self.is_master = bucket_size, bool(is_master)
        self.model = check_model(model, f"{_WHERE}.model")
        self.device = _device(device)
        self.timeouts = {k: _seconds(v, k) for k, v in (("publish_timeout_s", publish_timeout_s),
                                                       ("drain_timeout_s", drain_timeout_s),
                                                       ("receive_timeout_s", receive_timeout_s))}
        node = node or os.environ.get("TH_NODE") or (None if inside_ray else socket.gethostname())
        self._where = dict(hub=hub, host=host or os.environ.get("TH_HOST")) if hub else dict(cluster=cluster)
        self._token_file, self._options = token_file, dict(node=node, engine=engine, group=group,
                                                           chunk_bytes=chunk_bytes, device=str(self.device))
        self._name, self._reliable = name, reliable
        self._ep: list = []  # (a list: the finalizer below closes what it holds, not self)
        weakref.finalize(self, _close, self._ep, self.timeouts["drain_timeout_s"])
        self._sets = (_Set(), _Set())
        self._next = 0  # the set the next send writes; the other holds the newest version
        # The rollout's staging sets (1, or 2 with double_buffer), made at first use; which
        # set holds which version we hold; the set the last receive yielded from.
        self._staging: list[dict] = []
        self._buffers = 2 if double_buffer else 1
        self._held: dict[int, int] = {}
        self._current: Optional[int] = None
        self.last_send: dict = {}
        self.last_receive: dict = {}

    # --- what verl calls around every sync ----------------------------------------------

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        return {}, {}

    def init_process_group(self, **kwargs) -> None:
        pass

    def finalize(self) -> None:
        pass  # (the buffers stay published: see the module)

    def close(self) -> None:
        """Unpublish what we hold (each drain within ``drain_timeout_s``) and leave the hub."""
        _close(self._ep, self.timeouts["drain_timeout_s"])

    # --- trainer ----------------------------------------------------------------------

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: Optional[int] = None) -> dict:
        if not self.is_master:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        ep = await self._endpoint("trainer")
        newest = self._sets[1 - self._next]
        version = self._version(global_steps, newest.version)
        started = time.monotonic()
        if version == newest.version:
            await self._compare(weights, newest.tensors, version, global_steps)
            self.last_send = {"checkpoint_engine/version": float(version), "checkpoint_engine/resent": 1.0}
            return dict(self.last_send)
        target = self._sets[self._next]
        if target.version is not None:  # drains the readers still on it (contract 3)
            await asyncio.to_thread(ep.unpublish, self.model, target.version,
                                    timeout=self.timeouts["drain_timeout_s"])
            target.version = None
        drained = time.monotonic()
        nbytes = await self._fill(weights, target)
        filled = time.monotonic()
        ready = None
        if self.device.type == "cuda":  # our copies ran on this thread's stream; publish runs on another thread
            ready = torch.cuda.Event()
            ready.record()
        try:
            manifest = await asyncio.to_thread(ep.publish, self.model, version, target.tensors,
                                               timeout=self.timeouts["publish_timeout_s"], ready=ready)
        except BaseException:
            # The endpoint may still hold these tensors published: never write them again.
            target.tensors = {}
            raise
        target.version, self._next = version, 1 - self._next
        ended = time.monotonic()
        self.last_send = {"checkpoint_engine/version": float(version), "checkpoint_engine/resent": 0.0,
                          "checkpoint_engine/payload_mbytes": nbytes / 2**20,
                          "checkpoint_engine/tensors": float(len(target.tensors)),
                          "checkpoint_engine/chunks": float(len(manifest.chunks)),
                          "checkpoint_engine/drain_s": drained - started, "checkpoint_engine/fill_s": filled - drained,
                          "checkpoint_engine/publish_s": ended - filled, "checkpoint_engine/send_s": ended - started}
        return dict(self.last_send)

    def _version(self, global_steps: object, newest: Optional[int]) -> int:
        """The version step ``global_steps`` publishes as (see Versions in the module)."""
        if global_steps is None:
            return 1 if newest is None else newest + 1
        version = step_version(global_steps)
        if newest is not None and version < newest:
            raise BadArgument(f"global_steps={global_steps} is below step {newest - 1}, already published as "
                              f"{self.model}@{newest}: versions only increase")
        return version

    async def _fill(self, weights, target: _Set) -> int:
        """Copy the stream into ``target``, reusing a buffer where name, shape and dtype
        match. The whole stream is consumed even after a problem (other ranks may be in
        its collectives); problems raise at the end, before anything is published."""
        filled, problems, nbytes = {}, [], 0
        async for name, tensor in ensure_async_iterator(weights):
            if name in filled:
                problems.append(f"{name!r} came twice")
                continue
            buf = target.tensors.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            buf.copy_(tensor)
            filled[name], nbytes = buf, nbytes + buf.nbytes
        target.tensors = filled
        if problems or not filled:
            raise BadArgument(f"weights for {self.model}: " + ("; ".join(problems) or "the stream was empty"))
        return nbytes

    async def _compare(self, weights, held: dict, version: int, step: Optional[int]) -> None:
        seen, differ = set(), []
        async for name, tensor in ensure_async_iterator(weights):
            seen.add(name)
            mine = held.get(name)
            if mine is None or mine.shape != tensor.shape or mine.dtype != tensor.dtype or \
                    not torch.equal(mine, tensor.to(mine.device)):
                differ.append(name)
        differ += sorted(set(held) - seen)
        if differ:
            raise EndpointError(f"global_steps={step} was already published as {self.model}@{version} with "
                                f"other weights ({', '.join(map(repr, differ[:5]))}{' ...' if len(differ) > 5 else ''}): "
                                "a version's bytes never change; send a higher step")

    # --- rollout ----------------------------------------------------------------------

    @torch.no_grad()
    async def receive_weights(self, global_steps: Optional[int] = None):
        want = "latest" if global_steps is None else step_version(global_steps)
        ep = await self._endpoint("rollout")
        chosen: dict = {}
        try:
            # (`latest` resolves with the endpoint's group: see Groups in the module)
            version = await asyncio.to_thread(ep.fetch, self.model, want,
                                              into=lambda shards: self._destination(ep, shards, chosen),
                                              timeout=self.timeouts["receive_timeout_s"])
        except BaseException:
            if "i" in chosen:  # the fetch may have unpublished the set's version before failing
                kept = {(h.model, h.version) for h in ep.holdings()}
                self._held = {v: i for v, i in self._held.items() if i != chosen["i"] or (self.model, v) in kept}
            raise
        if "i" in chosen:  # the set's old version was unpublished before a byte landed
            self._held = {v: i for v, i in self._held.items() if i != chosen["i"]}
            self._held[version] = chosen["i"]
        elif version not in self._held:  # (the endpoint returned at once: it holds `version`, in one of our sets)
            raise EndpointError(f"{self.model}@{version} is held by the endpoint but in no staging set of ours")
        self._current = self._held[version]
        self.last_receive = {"version": version, **ep.last_fetch}
        for name, tensor in self._staging[self._current].items():
            yield name, tensor

    def _destination(self, ep, shards, chosen: dict) -> dict:
        """Where a version no set holds lands: the set after the current one (the same one
        with a single set), made to measure at its first use or when the tensors changed.
        Memory reused is drained by the endpoint (its old version is unpublished before a
        byte lands); memory replaced is drained here first, so two sets at most exist."""
        i = 0 if self._current is None else (self._current + 1) % self._buffers
        want = {k: (t.shape, t.dtype) for k, t in allocate(shards, device="meta").items()}
        if i < len(self._staging) and {k: (t.shape, t.dtype) for k, t in self._staging[i].items()} != want:
            for v in sorted(v for v, j in self._held.items() if j == i):
                ep.unpublish(self.model, v, timeout=self.timeouts["drain_timeout_s"])
                del self._held[v]
            self._staging[i] = {}  # (frees the old memory before the new is made)
        if i == len(self._staging):
            self._staging.append({})
        if not self._staging[i]:
            self._staging[i] = allocate(shards, device=str(self.device))
        chosen["i"] = i
        return self._staging[i]

    # --- the endpoint -----------------------------------------------------------------

    async def _endpoint(self, role: str):
        if not self._ep:
            self._ep.append(await asyncio.to_thread(self._connect, role))
        return self._ep[0]

    def _connect(self, role: str):
        name = self._name or f"verl-{role}-{self._options['node'] or socket.gethostname()}-{os.getpid()}"
        reliable = (role == "trainer") if self._reliable is None else self._reliable
        where = dict(self._where)
        if "hub" in where:
            where["token"] = Path(self._token_file).read_text().strip()
        options = dict(self._options, group=None if role == "trainer" else (self._options["group"] or replica_group()))
        if options["node"] is None and where.get("cluster") and not _on_ray(where["cluster"]):
            options["node"] = socket.gethostname()  # a cluster Ray does not run: the host name, as outside Ray
        return connect(**where, name=name, role=f"verl-{role}", reliable=reliable, **options)


def _on_ray(cluster: str) -> bool:
    """Whether the Ray cluster we run in runs TensorHub cluster ``cluster`` (``launcher:
    ray``: it places us by our Ray node, so no node needs naming)."""
    from ..launch.ray_lookup import clusters, in_ray

    return in_ray() and any(name == cluster for name, _ in clusters())


def step_version(global_steps: object) -> int:
    """verl's step ``global_steps`` as a TensorHub version: one above it (step 0, a run's
    first sync, is version 1; versions start at 1)."""
    if isinstance(global_steps, bool) or not isinstance(global_steps, int) or global_steps < 0:
        raise BadArgument(f"global_steps takes an int >= 0 (verl's step; version = step + 1) or None, "
                          f"not {global_steps!r}")
    return global_steps + 1


def replica_group() -> Optional[str]:
    """The default group of a rollout worker: its verl worker group in this Ray job
    (see Groups in the module), or None outside a verl worker."""
    prefix = os.environ.get("WG_PREFIX")
    if not prefix:
        return None
    import ray  # (verl's base module imports it: it is there)

    job = ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
    return f"verl-{job or 'nojob'}-{prefix}"


def _close(holder: list, drain_timeout: float) -> None:
    while holder:
        holder.pop().close(drain_timeout=drain_timeout)
