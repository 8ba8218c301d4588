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
- ``update_weights({"version": V})`` (an int or ``"latest"``; optional ``"timeout"``
  seconds for the whole fetch, default 120, and ``"wait": False`` to fail at once on a
  version that is not READY): fetch and verify V into a fresh *staging* copy in HF names
  (allocated from the manifest), then load it with ``model.load_weights`` inside a
  layerwise reload (vLLM's loader does the TP slicing and the q/k/v, gate/up fusion).
  The staging copy stays published: it is the holder a second engine reads from. The
  previous version's staging is unpublished only after the new one loaded, so a failed
  update leaves the previous weights serving and the previous staging published; errors
  raise (the orchestrator keeps inference paused). This is already the double-buffered
  update (issue 20): v stays published, a holder for joiners, while v+1 is fetched into
  its own staging; its unpublish comes after the load and returns once its readers
  drained and any retention copy the hub asked for exists (contract 4). No option
  needed: two staging copies at the peak of an update, one between updates.
- ``start_weight_update`` / ``finish_weight_update``: the pause around the update;
  ``metrics`` (last update) holds the fetch's stages from ``last_fetch`` plus ``load_s``
  and ``pause_s``; finish logs it.
- ``shutdown``: close the endpoint (which unpublishes the staging copy).

Why the layerwise reload runs inside ``receive_weights`` and not across start/finish as
in vLLM's IPC engine: ``initialize_layerwise_reload`` moves the parameters to meta, and
vLLM's worker never calls finish after a failed ``update_weights``; starting it only once
the bytes are here and verified keeps a failed fetch from touching the model.

Importing this module needs neither vLLM nor the endpoint stack: both are imported on use.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)

BACKEND = "tensorhub"
FETCH_TIMEOUT_S = 120.0
CLOSE_DRAIN_S = 30.0
_FETCH_STAGES = ("resolve_s", "setup_s", "plan_wait_s", "transfer_s", "verify_s", "wall_s")


def _fields(kind: str, given: Any, allowed: set[str]) -> dict:
    if not isinstance(given, dict):
        raise ValueError(f"{kind} must be a dict, not {type(given).__name__}")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(f"{kind}: unknown field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})")
    return given


def _text(kind: str, field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind}.{field} must be a non-empty str, not {value!r}")
    return value


@dataclass(frozen=True)
class InitInfo:
    """Where the hub is (``cluster``, or ``hub`` + ``token_file``) and which model to load."""

    model: str
    cluster: Optional[str] = None
    node: Optional[str] = None
    hub: Optional[str] = None
    token_file: Optional[str] = None
    name: Optional[str] = None
    engine: Optional[str] = None

    @classmethod
    def parse(cls, given: Any) -> "InitInfo":
        d = _fields("init_info", given, {"model", "cluster", "node", "hub", "token_file", "name", "engine"})
        if "model" not in d:
            raise ValueError("init_info.model is required (the TensorHub model name, e.g. 'policy')")
        for field, value in d.items():
            _text("init_info", field, value)
        if ("cluster" in d) == ("hub" in d):
            raise ValueError("init_info needs exactly one of cluster=NAME or hub=ADDR (with token_file=PATH)")
        if "hub" in d:
            if "token_file" not in d:
                raise ValueError("init_info.token_file is required with init_info.hub")
            if not Path(d["token_file"]).is_file():
                raise ValueError(f"init_info.token_file: no such file {d['token_file']!r}")
        elif "token_file" in d:
            raise ValueError("init_info.token_file goes with init_info.hub (a cluster knows its token)")
        if d.get("engine", "nixl") not in ("nixl", "tcp"):
            raise ValueError(f"init_info.engine must be 'nixl' or 'tcp', not {d['engine']!r}")
        return cls(**d)


@dataclass(frozen=True)
class UpdateInfo:
    """Which version to load, and how long to wait for it."""

    version: int | str
    timeout: float = FETCH_TIMEOUT_S
    wait: bool = True

    @classmethod
    def parse(cls, given: Any) -> "UpdateInfo":
        d = _fields("update_info", given, {"version", "timeout", "wait"})
        if "version" not in d:
            raise ValueError("update_info.version is required (an int, or 'latest')")
        version = d["version"]
        if not (version == "latest" or (isinstance(version, int) and not isinstance(version, bool) and version >= 0)):
            raise ValueError(f"update_info.version must be an int >= 0 or 'latest', not {version!r}")
        timeout = d.get("timeout", FETCH_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"update_info.timeout must be seconds > 0, not {timeout!r}")
        wait = d.get("wait", True)
        if not isinstance(wait, bool):
            raise ValueError(f"update_info.wait must be a bool, not {wait!r}")
        return cls(version, float(timeout), wait)


def staging_for(shards: list) -> tuple[dict, dict]:
    """(the fetch destination, the same memory as {HF name: whole tensor}) for a manifest.

    A version published as whole tensors is held as laid out (``layout.allocate``), so a
    second engine reads it chunk for chunk. One published in boxes (an FSDP trainer's
    shards) is assembled into whole tensors (``whole`` targets): ``load_weights`` wants
    whole HF tensors."""
    import torch

    from ..layout import allocate, whole

    if not any(t.global_shape for m in shards for t in m.tensors):
        into = allocate(shards)
        return into, into
    tensors = {}
    for m in shards:
        for t in m.tensors:
            if t.name not in tensors:
                shape = t.global_shape or t.shape
                tensors[t.name] = torch.empty(tuple(shape), dtype=getattr(torch, t.dtype))
    return {name: whole(name, t) for name, t in tensors.items()}, tensors


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
            self._staging: dict[int, dict] = {}  # version -> {HF name: tensor}; published while kept
            self._paused_at: Optional[float] = None
            self.metrics: dict = {}

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
            log.info("tensorhub: %s connected for model %s", self.endpoint.name, self.model_name)

        def start_weight_update(self) -> None:
            self._paused_at = time.monotonic()

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.endpoint is None:
                raise RuntimeError("update_weights before init_weight_transfer_engine: no TensorHub endpoint")
            self.metrics = {}  # a failed update leaves none (not the last one's)
            made: dict = {}

            def into(shards):
                destination, tensors = staging_for(shards)
                made["tensors"] = tensors
                return destination

            # (no group=: the endpoint resolves `latest` with the group it was connected with)
            version = self.endpoint.fetch(self.model_name, update_info.version, into=into,
                                          timeout=update_info.timeout, wait=update_info.wait)
            fetched = dict(self.endpoint.last_fetch or {})
            if "tensors" not in made:
                # `into` not called: we already hold `version` complete (our staging copy).
                if version != self.loaded or version not in self._staging:
                    raise RuntimeError(f"{self.endpoint.name}: fetch of {self.model_name}@{version} returned "
                                       "a replica this engine did not stage")
                self.metrics = {"version": version, **fetched, "load_s": 0.0}
                return
            staging = made["tensors"]
            self._staging[version] = staging
            started = time.monotonic()
            try:
                self._load(staging)
            except Exception as exc:
                restored = self._recover(version)
                # vLLM's loaders often fail on a bare assert: say what was being loaded.
                raise RuntimeError(f"{self.endpoint.name}: vLLM's load_weights failed on {self.model_name}@"
                                   f"{version} ({type(exc).__name__}: {exc}); {restored}") from exc
            self.metrics = {"version": version, **fetched, "load_s": time.monotonic() - started}
            previous, self.loaded = self.loaded, version
            if previous is not None and previous != version:
                self._drop(previous)

        def _load(self, staging: dict) -> None:
            from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload, initialize_layerwise_reload)

            initialize_layerwise_reload(self.model)
            try:
                with disable_mtp_completeness_check():
                    self.model.load_weights(staging.items())
            finally:
                # Always: it puts every layer back on its device (kernel tensors where
                # nothing loaded), so even a failed load leaves a runnable model.
                finalize_layerwise_reload(self.model, self.model_config)

        def _recover(self, failed: int) -> str:
            """A load that failed may have written some layers: load the previous staging
            copy again (when there is one), and let the failed version's copy go. Says
            what the model holds now."""
            self._drop(failed)
            if self.loaded is None or self.loaded not in self._staging:
                return "the model may hold part of it (no earlier TensorHub version to load back)"
            try:
                self._load(self._staging[self.loaded])
            except Exception as exc:
                log.exception("tensorhub: loading %s@%s back failed", self.model_name, self.loaded)
                return f"loading {self.model_name}@{self.loaded} back failed too ({type(exc).__name__}: {exc})"
            return f"{self.model_name}@{self.loaded} was loaded back and serves"

        def _drop(self, version: int) -> None:
            self._staging.pop(version, None)
            try:
                self.endpoint.unpublish(self.model_name, version, timeout=CLOSE_DRAIN_S)
            except Exception as exc:  # the copy is gone from our side either way; say so
                log.warning("tensorhub: unpublish %s@%s: %s", self.model_name, version, exc)

        def finish_weight_update(self) -> None:
            if self._paused_at is not None:
                self.metrics["pause_s"] = time.monotonic() - self._paused_at
                self._paused_at = None
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in self.metrics.items()}
            log.info("tensorhub: loaded %s@%s: %s", self.model_name, self.metrics.get("version"), shown)
            from ..endpoint import metrics as histograms  # (the fetch's own stages were observed by fetch)

            histograms.observe({k: v for k, v in self.metrics.items() if k in ("load_s", "pause_s")})

        def shutdown(self) -> None:
            endpoint, self.endpoint = self.endpoint, None
            self._staging.clear()
            self.loaded = None
            if endpoint is not None:
                endpoint.close(drain_timeout=CLOSE_DRAIN_S)

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
