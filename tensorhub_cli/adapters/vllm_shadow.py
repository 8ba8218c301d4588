"""The sharded path of the vLLM backend: each worker reads its own shard into a shadow,
outside the pause, and the pause applies it (``adapters.vllm`` drives it).

Protocol (one ``Shadows`` per worker; every method on the worker's own thread except
the prefetch it starts):

- ``Shadows(endpoint, model_name, model, device, emap)``: ``emap`` from
  ``layout.vllm_map.derive``.
- ``prefetch(version)``: a thread fetches ``version`` (``latest`` for a lone worker;
  otherwise the resolution rank 0 made and its engine's workers share, contract 2:
  ``adapters.vllm``; not waiting for one to turn READY) into
  a fresh shadow: ``emap.targets``, so the worker reads only the boxes its parameters
  hold (contract 9). Generation goes on meanwhile: nothing of the model is touched.
  Before it reads, it lets go (unpublish, with its drain) of any shadow other than
  the loaded version's, so at most two shadows exist (the loaded one, still
  published, and the one being read).
  Once read, the layers' post-load steps that can run beside the serving layers are
  run on stand-ins (``vllm_apply.prepare``).
- ``take(version, timeout, wait)`` → (version, shadow, fetch stages): the prefetch's
  result when it is the version asked for (``latest``: the one the prefetch
  resolved), else a fetch now (inside the pause, reported as such).
- ``swap(version, shadow)``: the pause's work: ``vllm_apply.apply``; on a failure part
  way the previous version's shadow is applied back.
- ``retire()``: after the pause, a thread unpublishes the previous version's shadow
  (its drain and any retention copy happen there, never inside a pause).
- ``close(timeout)``: joins the threads (bounded) and returns the versions still held
  (the adapter unpublishes them, then closes the endpoint).

A version whose tensors differ from those the map was derived for is refused before a
byte moves (``LayoutError`` from the fetch destination), and the model keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from ..errors import LayoutError

log = logging.getLogger(__name__)


class Shadows:
    def __init__(self, endpoint, model_name: str, model, device, emap) -> None:
        self.endpoint, self.model_name, self.model, self.device, self.emap = endpoint, model_name, model, device, emap
        self.held: dict[int, dict] = {}  # version -> shadow (published once complete)
        self.loaded: Optional[int] = None
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[dict] = None
        self._retiring: list[threading.Thread] = []
        self._previous: Optional[int] = None
        self._prepared: Optional[tuple] = None  # (version, vllm_apply.prepare's stand-ins)

    # ---- the fetch destination ----

    def _into(self, made: dict):
        def into(shards):
            tensors = {}
            for m in shards:
                for t in m.tensors:
                    tensors[t.name] = (tuple(t.global_shape or t.shape), t.dtype)
            problems = self.emap.check(tensors)
            if problems:
                raise LayoutError(f"{self.model_name}: the version's tensors are not the model's", problems)
            shadow = self.emap.allocate(self.device)
            made["shadow"] = shadow
            return self.emap.targets(shadow)
        return into

    def _fetch(self, version, timeout: float, wait: bool) -> dict:
        made: dict = {}
        got = self.endpoint.fetch(self.model_name, version, into=self._into(made), timeout=timeout, wait=wait)
        stages = dict(self.endpoint.last_fetch or {})
        shadow = made.get("shadow")
        with self._lock:
            if shadow is not None:
                self.held[got] = shadow
            elif got not in self.held:
                raise RuntimeError(f"{self.endpoint.name}: fetch of {self.model_name}@{got} returned a replica "
                                   "this engine did not make")
        return {"version": got, "stages": stages}

    # ---- outside the pause ----

    def prefetch(self, version, timeout: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            return

        def run():
            started = time.monotonic()
            try:
                self._drop_spares()
                self._result = {**self._fetch(version, timeout, wait=False), "error": None}
            except Exception as exc:  # (the pause fetches what it is asked for; say why here)
                self._result = {"version": None, "error": exc}
            fetched = time.monotonic()
            self._result["prefetch_s"] = fetched - started
            got = self._result["version"]
            if got is not None and got != self.loaded:
                try:  # (the post-load steps that can run beside the serving layers)
                    self._prepared = (got, prepare(self.model, self.emap, self.held[got]))
                except Exception as exc:
                    log.warning("tensorhub: preparing %s@%s outside the pause failed (%s: %s); its post-load "
                                "steps run in the pause", self.model_name, got, type(exc).__name__, exc)
            self._result["prepare_s"] = time.monotonic() - fetched

        from ..layout.vllm_apply import prepare

        self._result, self._prepared = None, None
        self._thread = threading.Thread(target=run, name=f"th-prefetch-{self.endpoint.name}", daemon=True)
        self._thread.start()

    def _drop_spares(self) -> None:
        with self._lock:
            spares = [(v, self.held.pop(v)) for v in list(self.held) if v != self.loaded]
        for v, shadow in spares:
            self._unpublish(v, shadow)

    def _unpublish(self, version: int, shadow: dict) -> None:
        """(``shadow``: kept alive here until the drain let it go.)"""
        try:
            self.endpoint.unpublish(self.model_name, version, timeout=30.0)
        except Exception as exc:  # (our copy is let go either way)
            log.warning("tensorhub: unpublish %s@%s: %s", self.model_name, version, exc)
        del shadow

    def prefetched(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    # ---- the pause ----

    def take(self, version, timeout: float, wait: bool) -> dict:
        started = time.monotonic()
        result = None
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.endpoint.name}: the prefetch of {self.model_name} still runs after "
                                   f"{timeout:.0f}s")
            self._thread, result = None, self._result
        waited = time.monotonic() - started
        if result is not None and result["error"] is None and version in ("latest", result["version"]):
            # (``latest``: what the read ahead resolved, or was told, at start_weight_update)
            return {**result, "wait_s": waited, "in_pause": False}
        if result is not None and result["error"] is not None:
            log.info("tensorhub: the prefetch of %s failed (%s); fetching %s@%s in the pause",
                     self.model_name, result["error"], self.model_name, version)
        got = self._fetch(version, timeout, wait)
        return {**got, "wait_s": waited, "in_pause": True, "prefetch_s": (result or {}).get("prefetch_s", 0.0)}

    def swap(self, version: int) -> dict:
        from ..layout.vllm_apply import apply

        if version == self.loaded:
            return {"copy": 0.0, "process": 0.0, "prepared": 0.0}
        prepared, self._prepared = self._prepared, None
        try:
            spent = apply(self.model, self.emap, self.held[version],
                          prepared[1] if prepared is not None and prepared[0] == version else None)
        except Exception as exc:
            back = self._apply_back()
            raise RuntimeError(f"{self.endpoint.name}: applying {self.model_name}@{version} failed "
                               f"({type(exc).__name__}: {exc}); {back}") from exc
        self._previous, self.loaded = self.loaded, version
        return spent

    def _apply_back(self) -> str:
        from ..layout.vllm_apply import apply

        if self.loaded is None or self.loaded not in self.held:
            return "the model may hold part of it (no earlier TensorHub version to apply back)"
        try:
            apply(self.model, self.emap, self.held[self.loaded])
        except Exception as exc:
            return f"applying {self.model_name}@{self.loaded} back failed too ({type(exc).__name__}: {exc})"
        return f"{self.model_name}@{self.loaded} was applied back and serves"

    # ---- after the pause ----

    def retire(self) -> None:
        previous, self._previous = self._previous, None
        with self._lock:
            if previous is None or previous == self.loaded or previous not in self.held:
                return
            shadow = self.held.pop(previous)
        thread = threading.Thread(target=self._unpublish, args=(previous, shadow), daemon=True,
                                  name=f"th-retire-{self.endpoint.name}")
        self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]
        thread.start()

    def close(self, timeout: float) -> set:
        """Joins the threads (within ``timeout``); returns the versions still held."""
        deadline = time.monotonic() + timeout
        for thread in [self._thread, *self._retiring]:
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            held = set(self.held)
            self.held.clear()
        return held

    def slices(self) -> list:
        """(HF name, box, view) of every slot of the loaded version's shadow (tests)."""
        shadow = self.held.get(self.loaded)
        if shadow is None:
            return []
        return [(s.name, s.box, s.view) for t in self.emap.targets(shadow).values() for s in t.slots]
