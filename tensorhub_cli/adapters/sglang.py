"""SGLang's custom weight loader, backed by TensorHub:
``--custom-weight-loader tensorhub_cli.adapters.sglang.load``.

How SGLang calls it (read from sglang 0.5.23's code; SGLang is not installed or run
here: it needs its own CUDA build of torch, and these machines are CPU-only).
``--custom-weight-loader`` only lists the import paths a weight update may name; the
startup load still reads ``--model-path``. An update is
``Engine.update_weights_from_tensor(named_tensors, load_format="tensorhub_cli.adapters.sglang.load")``
(HTTP: ``POST /update_weights_from_tensor`` with that ``load_format``): every TP rank's
``WeightUpdater.update_weights_from_tensor`` deserializes its copy of ``named_tensors``
(a list of ``(name, tensor)``, moved to the rank's device) and calls
``dynamic_import(load_format)(model, named_tensors)``, that is ``load(model,
named_tensors)`` here, on its scheduler thread. The return value is ignored; an
exception fails the update (SGLang then says the weights may be partly updated).

Protocol of ``load(model, named_tensors)``:

1. The version: ``named_tensors`` carries no weights here, only control: empty, or one
   entry ``("tensorhub.version", 0-d integer tensor)`` naming the version to load;
   without it, ``TH_VERSION`` (an int or ``latest``, the default). Any other entry is a
   ``BadArgument`` naming it, before anything is fetched: weights from two sources in
   one update would be ambiguous.
2. The endpoint: one per process (each TP rank is one), connected at the first load
   from the environment the server was started with, closed at exit:
   ``TH_CLUSTER`` + ``TH_NODE`` (a cluster `th up` started), or ``TH_HUB`` +
   ``TH_TOKEN_FILE`` (or ``TH_TOKEN``); ``TH_MODEL`` (required); ``TH_NAME``, the
   prefix of the endpoint's name ``PREFIX-HOST-PID`` (default ``sglang``: the TP ranks
   share the server's environment, the pid tells them apart); ``TH_GROUP`` (the
   instance's ranks resolve ``latest`` together, contract 2: the endpoint resolves every
   fetch with its group; default ``sglang-HOST-PPID``: SGLang starts every scheduler
   (one per TP rank) from the server's process, so the ranks on one node share it;
   a TP instance spanning nodes must set ``TH_GROUP``, one name per instance);
   ``TH_ENGINE`` (nixl or tcp); ``TH_FETCH_TIMEOUT_S`` (default 600);
   ``TH_DOUBLE_BUFFER`` (``1``: two staging sets, see 3; default ``0``). It is a spot
   endpoint (``reliable=False``): an inference server's copy does not count towards
   retention.
3. The fetch: into a host-memory staging dict by HF names, made to measure at the
   first load (``hf.allocate_global``: one tensor per name). Until it is overwritten
   the staging copy is a replica other readers may read from. By default every later
   version lands in that same memory, so the endpoint unpublishes (drains) the
   previous version the moment the next fetch starts (contract 3). With
   ``TH_DOUBLE_BUFFER=1`` two sets alternate: version v+1 lands in the set v does not
   occupy, so v stays published while v+1 is fetched and loaded, and is unpublished
   (with its drain, and any retention copy the hub asks for first) only when v+2 needs
   its set. Twice the staging memory, allocated once; the model's own weights change
   only in step 4 either way. A version already in a set is not fetched again.
4. ``model.load_weights(staging.items())``: SGLang's models take HF-named full tensors
   and do their own TP slicing and ``qkv_proj`` / ``gate_up_proj`` fusing, as vLLM's do,
   so each rank reads the whole version (the model's own layout is not TensorHub's to
   address). Returns the version loaded.

Tested against a transformers Llama wrapped in a module whose ``load_weights`` copies
by name (the same contract), with a real hub: ``tests/unit/test_adapter_sglang.py``.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
from typing import Iterable, Optional

from ..errors import BadArgument

VERSION_KEY = "tensorhub.version"
_lock = threading.Lock()
# staging: the set the model was last loaded from; sets: every staging set (1, or 2
# double-buffered), held: version -> index of the set holding it
_state: dict = {"ep": None, "staging": None, "sets": [], "held": {}}


def _env(name: str, default: Optional[str] = None) -> str:
    value = os.environ.get(name, default)
    if value is None or value == "":
        raise BadArgument(f"{name} is not set: the TensorHub SGLang loader reads its cluster and model from the "
                          "environment (see tensorhub_cli.adapters.sglang)")
    return value


def _version(named_tensors: Iterable) -> int | str:
    chosen: int | str | None = None
    for name, tensor in named_tensors:
        if name != VERSION_KEY:
            raise BadArgument(f"named_tensors: {name!r} is not {VERSION_KEY!r}; the TensorHub loader fetches the "
                              "weights itself and takes only the version to load")
        if getattr(tensor, "numel", lambda: 0)() != 1 or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise BadArgument(f"named_tensors: {VERSION_KEY!r} must be one integer, not {tensor!r}")
        chosen = int(tensor.item())
    if chosen is not None:
        return chosen
    text = _env("TH_VERSION", "latest")
    if text == "latest":
        return text
    try:
        return int(text)
    except ValueError:
        raise BadArgument(f"TH_VERSION must be a number or 'latest', not {text!r}") from None


def _connect():
    from ..api import connect

    name = f"{os.environ.get('TH_NAME') or 'sglang'}-{socket.gethostname()}-{os.getpid()}"
    group = os.environ.get("TH_GROUP") or f"sglang-{socket.gethostname()}-{os.getppid()}"
    options = dict(name=name, role="rollout", reliable=False, group=group, engine=os.environ.get("TH_ENGINE") or None)
    if os.environ.get("TH_CLUSTER"):
        return connect(cluster=os.environ["TH_CLUSTER"], node=_env("TH_NODE"), **options)
    hub = _env("TH_HUB")
    token = os.environ.get("TH_TOKEN")
    if not token:
        path = _env("TH_TOKEN_FILE")
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise BadArgument(f"TH_TOKEN_FILE {path!r} cannot be read: {exc.strerror}") from None
    return connect(hub=hub, token=token, **options)


def _buffers() -> int:
    text = _env("TH_DOUBLE_BUFFER", "0").strip().lower()
    if text not in ("0", "1", "false", "true", "no", "yes"):
        raise BadArgument(f"TH_DOUBLE_BUFFER must be 1 or 0, not {os.environ['TH_DOUBLE_BUFFER']!r}")
    return 2 if text in ("1", "true", "yes") else 1


def load(model, named_tensors) -> int:
    """SGLang's custom weight loader: fetch the TensorHub version the environment (or
    ``named_tensors``) names and hand it to ``model.load_weights`` by HF names."""
    from .hf import allocate_global

    version = _version(named_tensors or [])
    model_name = _env("TH_MODEL")
    try:
        timeout = float(_env("TH_FETCH_TIMEOUT_S", "600"))
    except ValueError:
        raise BadArgument(f"TH_FETCH_TIMEOUT_S must be seconds, not {os.environ['TH_FETCH_TIMEOUT_S']!r}") from None
    buffers = _buffers()
    if not callable(getattr(model, "load_weights", None)):
        raise BadArgument(f"model: {type(model).__name__} has no load_weights(iterable of (name, tensor))")
    with _lock:  # one update at a time per process: they share the staging memory
        if _state["ep"] is None:
            _state["ep"] = _connect()
        ep, sets, held = _state["ep"], _state["sets"], _state["held"]
        current = next((i for i, s in enumerate(sets) if s is _state["staging"]), None)
        chosen: dict = {}

        def target(shards) -> dict:
            # Called only for a version no set holds: the set after the current one (the
            # same one with a single set), made at its first use. The endpoint unpublishes
            # what it held before a byte lands.
            i = 0 if current is None else (current + 1) % buffers
            if i == len(sets):
                sets.append(allocate_global(shards))
            chosen["i"] = i
            return sets[i]

        got = ep.fetch(model_name, version, into=target, timeout=timeout)  # (`latest`: with the endpoint's group)
        if "i" in chosen:  # the set's old version was unpublished before the fetch
            for v in [v for v, i in held.items() if i == chosen["i"]]:
                del held[v]
            held[got] = chosen["i"]
        # (else the endpoint returned at once: it holds `got` complete, in the set it was
        # fetched into; an entry left by a failed fetch names a version it no longer holds)
        _state["staging"] = staging = sets[held[got]]
        model.load_weights(iter(staging.items()))
        return got


def close(drain_timeout: float = 30.0) -> None:
    """Leave the cluster (at exit; tests call it): the staging copy is unpublished, with a
    drain of at most ``drain_timeout`` seconds."""
    with _lock:
        ep, _state["ep"], _state["staging"], _state["sets"], _state["held"] = _state["ep"], None, None, [], {}
    if ep is not None:
        ep.close(drain_timeout=drain_timeout)


atexit.register(close)
