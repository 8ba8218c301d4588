"""The whole-tensor path of the vLLM backend: where a worker's map cannot be derived,
it fetches the version in HF names and loads it with the model's own ``load_weights``
(``adapters.vllm`` drives it; ``vllm_shadow`` is the sharded path).

Protocol (one ``Whole`` per worker, on the worker's thread):

- ``Whole(endpoint, model_name, model, model_config)``.
- ``receive(update_info)`` → the update's metrics (the fetch's stages, ``load_s``):
  fetches the version (``latest`` with the endpoint's group) into a fresh staging copy
  (``staging_for``: the manifest's own layout, or whole HF tensors assembled from a
  version published in boxes), then loads it inside vLLM's layerwise reload
  (``initialize_layerwise_reload``, ``load_weights``, ``finalize_layerwise_reload``),
  keeps it published (a second engine reads it) and unpublishes the previous copy.
  A fetch that returns the copy we already hold loads nothing. A failed load loads
  the previous copy back where there is one, lets the failed version's copy go, and
  raises saying what the model holds.
- ``loaded``: the version the model holds (None: its own from disk); ``staging``:
  {version: {HF name: tensor}}, published while kept; ``held_slices()`` for tests.

Why the layerwise reload runs inside ``receive`` and not across start/finish as in
vLLM's IPC engine: ``initialize_layerwise_reload`` moves the parameters to meta, and
vLLM's worker never calls finish after a failed ``update_weights``; starting it only
once the bytes are here and verified keeps a failed fetch from touching the model.
vLLM's "<Layer>: Failed to load weights" is dropped for buffer-only layers (a rotary
embedding: nothing in a checkpoint loads it; ``QuietBufferOnly``).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger(__name__)

CLOSE_DRAIN_S = 30.0
LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


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


class QuietBufferOnly(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for the layer classes of ``model``
    that hold buffers and no parameter (a rotary embedding's cos/sin cache): nothing in
    a checkpoint loads them, so the warning is spurious on every reload. A class with a
    parameter anywhere in the model keeps its warning."""

    MESSAGE = "%s: Failed to load weights"

    def __init__(self, model) -> None:
        super().__init__()
        with_params, buffer_only = set(), set()
        for module in model.modules():
            name = type(module).__name__
            if any(True for _ in module.parameters(recurse=False)):
                with_params.add(name)
            elif any(True for _ in module.buffers(recurse=False)):
                buffer_only.add(name)
        self.classes = buffer_only - with_params

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.MESSAGE and record.args and record.args[0] in self.classes)


class Whole:
    def __init__(self, endpoint, model_name: str, model, model_config) -> None:
        self.endpoint, self.model_name, self.model, self.model_config = endpoint, model_name, model, model_config
        self.loaded: Optional[int] = None
        self.staging: dict[int, dict] = {}

    def receive(self, update_info) -> dict:
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
            if version != self.loaded or version not in self.staging:
                raise RuntimeError(f"{self.endpoint.name}: fetch of {self.model_name}@{version} returned "
                                   "a replica this engine did not stage")
            return {"version": version, **fetched, "load_s": 0.0}
        staging = made["tensors"]
        self.staging[version] = staging
        started = time.monotonic()
        try:
            self._load(staging)
        except Exception as exc:
            restored = self._recover(version)
            # vLLM's loaders often fail on a bare assert: say what was being loaded.
            raise RuntimeError(f"{self.endpoint.name}: vLLM's load_weights failed on {self.model_name}@"
                               f"{version} ({type(exc).__name__}: {exc}); {restored}") from exc
        metrics = {"version": version, **fetched, "load_s": time.monotonic() - started}
        previous, self.loaded = self.loaded, version
        if previous is not None and previous != version:
            self._drop(previous)
        return metrics

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
            quiet = QuietBufferOnly(self.model)
            logging.getLogger(LAYERWISE_LOGGER).addFilter(quiet)
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                logging.getLogger(LAYERWISE_LOGGER).removeFilter(quiet)

    def _recover(self, failed: int) -> str:
        """A load that failed may have written some layers: load the previous staging
        copy again (when there is one), and let the failed version's copy go. Says
        what the model holds now."""
        self._drop(failed)
        if self.loaded is None or self.loaded not in self.staging:
            return "the model may hold part of it (no earlier TensorHub version to load back)"
        try:
            self._load(self.staging[self.loaded])
        except Exception as exc:
            log.exception("tensorhub: loading %s@%s back failed", self.model_name, self.loaded)
            return f"loading {self.model_name}@{self.loaded} back failed too ({type(exc).__name__}: {exc})"
        return f"{self.model_name}@{self.loaded} was loaded back and serves"

    def _drop(self, version: int) -> None:
        self.staging.pop(version, None)
        try:
            self.endpoint.unpublish(self.model_name, version, timeout=CLOSE_DRAIN_S)
        except Exception as exc:  # the copy is gone from our side either way; say so
            log.warning("tensorhub: unpublish %s@%s: %s", self.model_name, version, exc)

    def held_slices(self) -> list:
        return [(name, None, t) for name, t in self.staging.get(self.loaded, {}).items()]
