"""vLLM weight-transfer backend ``"tensorhub"``: every vLLM worker fetches a version from TensorHub.

Protocol (vLLM's ``WeightTransferEngine`` lifecycle, driven by ``LLM`` or the RLHF routes):

- ``register()`` (the ``vllm.general_plugins`` entry point, run in every vLLM process,
  possibly several times) registers ``TensorHubWeightTransferEngine`` as ``"tensorhub"``.
- ``init_weight_transfer_engine(init_info)``: ``{"cluster": NAME, "model": NAME}`` or
  ``{"hub": "tcp://HOST:PORT", "token_file": PATH, "model": NAME}``; optional ``"node"``
  (the node we run on: with a cluster, one of its spec's nodes, default this host's name;
  with a hub, default the endpoint's), ``"name"`` (default unique per engine and rank)
  and ``"engine"`` (``"nixl"``/``"tcp"``). Each worker connects its own endpoint; the workers
  of one engine instance (its TP/PP ranks, per DP rank) connect with one TensorHub group,
  ``vllm-<instance_id>-dp<N>``, and the endpoint resolves every fetch with its group, so
  all of them load the same version of ``latest`` even when a newer one turns READY
  between their fetches (contract 2).
- At init each worker derives the map from HF names to its own parameters from the
  loaded model (``layout.vllm_map``: the model's ``load_weights`` recorded over
  stand-ins, each parameter's weight loader replayed into probes), for the tensors of
  the checkpoint the engine started from (its safetensors headers). Where it maps
  (the *shard* path, ``vllm_shadow``):

  - ``start_weight_update`` starts a thread that fetches ``latest`` (with several
    workers: the newest READY version, which rank 0 resolves for all of them and
    broadcasts over vLLM's group, so the hub answers one resolve per engine) into a
    fresh *shadow* of this worker's raw parameters: it reads only the boxes they hold
    (contract 9), while the engine goes on generating;
  - ``update_weights({"version": V})`` (an int or ``"latest"``; ``"timeout"`` seconds,
    default 120; ``"wait": False`` to fail at once on a version that is not READY)
    takes that shadow when it is V (``latest``: the one the prefetch resolved), else
    fetches V now (reported: ``fetch_in_pause``), and applies it: copied into the live
    parameters in place, or, for a layer vLLM repacks or quantizes after loading, put
    through that layer's own post-load step from a copy (``layout.vllm_apply``): on a
    stand-in of the layer right after the read, outside the pause, where that step
    touches only the layer (vLLM's unquantized linear and embedding methods: a oneDNN
    handle on CPU), so the pause only swaps it in; in the pause otherwise (a fused
    MoE). No ``load_weights``, no layerwise reload;
  - ``finish_weight_update`` logs one INFO line through vLLM's logger and starts the
    previous version's unpublish on a thread: its drain (and any retention copy) is
    never inside a pause. The shadow stays published: a second engine reads from it.

  A version whose tensors differ from the checkpoint's is refused before a byte moves.
  Where the map cannot be derived (a loader that transposes or repacks on load, no
  local checkpoint), the worker says so once and takes the *whole* path
  (``vllm_whole``): the version in HF names into a staging copy, loaded by
  ``model.load_weights`` inside vLLM's layerwise reload (its loader slices and fuses),
  the staging copy kept published and the previous one unpublished after the load.
- ``metrics`` (last update): the fetch's stages (``last_fetch``), ``path``,
  ``shard_bytes``, and the pause's stages: ``take_s`` (getting the shadow: ``wait_s``
  for the read ahead, ``fetch_in_pause_s`` where it missed), ``load_s`` (the apply: ``copy_s`` + ``process_s`` +
  ``prepared_s``; ``prepare_s`` was spent before the pause),
  ``between_s`` (vLLM's own time between update_weights and finish), ``finish_s``,
  summing to ``pause_s`` (update_weights' start to finish's end).
- ``shutdown``: joins the adapter's threads (bounded) and closes the endpoint (which
  unpublishes what it holds).

This module is the engine's hooks (registration, init, the lifecycle above, shutdown);
the update flows are ``vllm_shadow`` (sharded) and ``vllm_whole`` (whole tensors), what
the user sees is ``vllm_report``.

Importing this module needs neither vLLM nor the endpoint stack: both are imported on use.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .agree import agree
from .vllm_info import FETCH_TIMEOUT_S, InitInfo, UpdateInfo
from .vllm_report import expose_metrics, summary, vlog
from .vllm_whole import CLOSE_DRAIN_S, QuietBufferOnly, Whole, staging_for

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
__all__ = ["BACKEND", "InitInfo", "UpdateInfo", "QuietBufferOnly", "register", "staging_for", "summary"]


def withdraw(endpoint, model: str, versions: set, deadline: float) -> None:
    """Shutdown (vLLM calls it as the engine exits): unpublish our copies side by side,
    all within ``deadline``, then close. A hub that does not answer at once gets no
    drain: nothing can be acknowledged, and it drops our references when our beats
    stop (contract 6); readers of ours then fail over to other holders."""
    import threading

    try:
        endpoint.versions(model, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
    except Exception as exc:  # (HubUnreachable, or the hub knows no such model: no drain to wait for)
        reachable = getattr(exc, "code", None) == "not_found"
    else:
        reachable = True
    if reachable:
        def one(version):
            try:
                endpoint.unpublish(model, version, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("tensorhub: unpublish %s@%s at shutdown: %s", model, version, exc)

        threads = [threading.Thread(target=one, args=(v,), daemon=True) for v in sorted(versions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    endpoint.close(drain_timeout=min(2.0, max(0.0, deadline - time.monotonic())) if reachable else 0)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register backend ``"tensorhub"`` (idempotent:
    vLLM loads plugins in every process, sometimes more than once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "TensorHubWeightTransferEngine")


def _engine_class():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class TensorHubWeightTransferEngine(WeightTransferEngine):
        """Loads TensorHub versions into this worker's model (see the module docstring)."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        # One staging copy per model name; a draft model is another weight set.
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.endpoint = None
            self.model_name: Optional[str] = None
            self.loaded: Optional[int] = None  # the version the model holds (None: its own from disk)
            self.whole = None  # the whole-tensor path (vllm_whole): its staging copies, published while kept
            self._paused_at: Optional[float] = None
            self.metrics: dict = {}
            self._received_at: Optional[float] = None
            self.shadows = None  # the sharded path (vllm_shadow), once its map is derived
            self.classes: dict[str, str] = {}  # parameter class -> "copy" / "process" (the sharded path)
            self.path_reason: Optional[str] = None  # why the whole-tensor path, where it is taken

        def parse_init_info(self, init_dict: dict) -> InitInfo:
            return InitInfo.parse(init_dict)

        def parse_update_info(self, update_dict: dict) -> UpdateInfo:
            return UpdateInfo.parse(update_dict)

        def _rank(self) -> tuple[int, int]:
            pc = self.parallel_config
            return getattr(pc, "data_parallel_index", 0) or 0, getattr(pc, "rank", 0) or 0

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            from ..api import connect

            if self.endpoint is not None:
                raise RuntimeError(f"init_weight_transfer_engine: {self.endpoint.name} is already connected; "
                                   "shut the weight transfer engine down first")
            dp, rank = self._rank()
            # instance_id is made once per engine and pickled to its workers; without one,
            # the engine core is every local worker's parent (never our own pid: each
            # worker would be a group of its own).
            instance = self.vllm_config.instance_id or f"{socket.gethostname()}-{os.getppid()}"
            name = init_info.name or f"vllm-{socket.gethostname()}-{instance}-dp{dp}-r{rank}"
            if init_info.name and (self.parallel_config.world_size_across_dp > 1):
                name = f"{init_info.name}-dp{dp}-r{rank}"  # one endpoint per worker, each named
            # The workers of one engine resolve `latest` together (contract 2): with TP or PP
            # each holds a piece of one model, which must be one version.
            group = f"vllm-{instance}-dp{dp}" if self.parallel_config.world_size > 1 else None
            options = dict(name=name, role="vllm", group=group, engine=init_info.engine, node=init_info.node)
            options = {k: v for k, v in options.items() if v is not None}
            if init_info.cluster is not None:
                options.setdefault("node", socket.gethostname())
                self.endpoint = connect(cluster=init_info.cluster, **options)
            else:
                token = Path(init_info.token_file).read_text().strip()
                self.endpoint = connect(hub=init_info.hub, token=token, **options)
            self.model_name = init_info.model
            self.whole = Whole(self.endpoint, self.model_name, self.model, self.model_config)
            log.info("tensorhub: %s connected for model %s", self.endpoint.name, self.model_name)
            expose_metrics()
            self._derive()

        def _derive(self) -> None:
            """The sharded path's map, from the checkpoint the engine started from (its
            safetensors headers: names, shapes, dtypes) and the loaded model; or the
            whole-tensor path, said once, with why."""
            from ..layout.vllm_map import Unmapped, checkpoint_tensors, derive
            from .vllm_shadow import Shadows

            self.path_reason = None
            tensors = checkpoint_tensors(getattr(self.model_config, "model", None))
            if tensors is None:
                self.path_reason = "no local safetensors checkpoint to derive the map from"
            else:
                try:
                    emap = derive(self.model, tensors)
                except Unmapped as exc:
                    self.path_reason = str(exc)
                else:
                    self.shadows = Shadows(self.endpoint, self.model_name, self.model, self.device, emap)
                    self.classes = dict(emap.classes)
                    vlog().info("tensorhub: %s reads its shard (%d bytes) into a shadow; per parameter class: %s",
                                self.endpoint.name, emap.shard_bytes,
                                ", ".join(f"{c}={m}" for c, m in sorted(emap.classes.items())))
                    return
            vlog().warning("tensorhub: %s falls back to whole tensors through load_weights (every worker reads "
                           "the whole model): %s", self.endpoint.name, self.path_reason)

        def start_weight_update(self) -> None:
            self._paused_at = time.monotonic()
            if self.shadows is not None:  # generation goes on while v+1 is read
                version = self._agree_latest()
                if version is not None:
                    self.shadows.prefetch(version, FETCH_TIMEOUT_S)

        def _agree_latest(self):
            """The version every worker of this engine reads (contract 2): ``latest``
            alone; with several, rank 0's resolution of the newest READY one, shared
            over vLLM's own group (``agree``; on the worker's thread: no collective
            beside the model's). None: no READY version yet."""
            pc = self.parallel_config
            if pc.world_size == 1:
                return "latest"
            from vllm.distributed import get_tp_group, get_world_group

            group = get_tp_group() if pc.pipeline_parallel_size == 1 else get_world_group()
            return agree(self.endpoint, self.model_name, "latest", group)

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.endpoint is None:
                raise RuntimeError("update_weights before init_weight_transfer_engine: no TensorHub endpoint")
            self.metrics = {}  # a failed update leaves none (not the last one's)
            if self.shadows is not None:
                self._receive_shard(update_info)
            else:
                self._receive_whole(update_info)

        def _receive_shard(self, update_info: UpdateInfo) -> None:
            self._paused_at = started = time.monotonic()
            got = self.shadows.take(update_info.version, update_info.timeout, update_info.wait)
            taken = time.monotonic()
            spent = self.shadows.swap(got["version"])
            applied = time.monotonic()
            stages = got["stages"]
            self.metrics = {"version": got["version"], "path": "shard", **stages,
                            "shard_bytes": self.shadows.emap.shard_bytes, "take_s": taken - started,
                            "wait_s": got["wait_s"],
                            "fetch_in_pause": got["in_pause"],
                            "fetch_in_pause_s": taken - started - got["wait_s"] if got["in_pause"] else 0.0,
                            "prefetch_s": got.get("prefetch_s", 0.0), "prepare_s": got.get("prepare_s", 0.0),
                            "load_s": applied - taken, "copy_s": spent["copy"], "process_s": spent["process"],
                            "prepared_s": spent["prepared"]}
            self.loaded = got["version"]
            self._received_at = applied  # (what follows counts as vLLM's: between_s)

        def _receive_whole(self, update_info: UpdateInfo) -> None:
            self.metrics = self.whole.receive(update_info)
            self.loaded = self.whole.loaded

        def finish_weight_update(self) -> None:
            started = time.monotonic()
            if self.shadows is not None:
                self.shadows.retire()  # the previous version's unpublish: after the pause, off this thread
            ended = time.monotonic()
            received, self._received_at = self._received_at, None
            if received is not None and self.metrics:
                # (the pause's stages: ours, and what vLLM did between update_weights and here)
                self.metrics["between_s"] = started - received
                self.metrics["finish_s"] = ended - started
            if self._paused_at is not None:
                self.metrics["pause_s"] = ended - self._paused_at
                self._paused_at = None
            vlog().info("tensorhub: %s", summary(self.model_name, self.metrics))
            from ..endpoint import metrics as histograms  # (the fetch's own stages were observed by fetch)

            histograms.observe({k: v for k, v in self.metrics.items() if k in ("load_s", "pause_s")})

        def held_slices(self) -> list:
            """(HF name, box or None for the whole tensor, tensor) of what this worker
            holds of the loaded version (tests compare it with the checkpoint)."""
            if self.shadows is not None:
                return self.shadows.slices()
            return self.whole.held_slices() if self.whole is not None else []

        def shutdown(self) -> None:
            endpoint, self.endpoint = self.endpoint, None
            shadows, self.shadows = self.shadows, None
            deadline = time.monotonic() + CLOSE_DRAIN_S
            versions = set(self.whole.staging) if self.whole is not None else set()
            if shadows is not None:
                versions |= shadows.close(CLOSE_DRAIN_S / 2)  # (its threads joined: what it still holds)
            if self.whole is not None:
                self.whole.staging.clear()
            self.loaded = None
            if endpoint is not None:
                withdraw(endpoint, self.model_name, versions, deadline)

    TensorHubWeightTransferEngine.__module__ = __name__
    TensorHubWeightTransferEngine.__qualname__ = "TensorHubWeightTransferEngine"
    return TensorHubWeightTransferEngine


_built: dict[str, type] = {}


def __getattr__(name: str):
    # The engine class subclasses vLLM's, so it exists only once vLLM is imported: here,
    # on first access (the factory's lazy loader does getattr(module, class name)).
    if name == "TensorHubWeightTransferEngine":
        if name not in _built:
            _built[name] = _engine_class()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
