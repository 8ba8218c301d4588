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
   instance's ranks resolve ``latest`` together, contract 2; default none);
   ``TH_ENGINE`` (nixl or tcp); ``TH_FETCH_TIMEOUT_S`` (default 600). It is a spot endpoint (``reliable=False``):
   an inference server's copy does not count towards retention.
3. The fetch: into a host-memory staging dict by HF names, made to measure at the
   first load (``hf.allocate_global``: one tensor per name), then the same memory for every later version (the
   endpoint unpublishes the previous version from it first, contract 3); until then
   the staging copy is a replica other readers may read from.
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
_state: dict = {"ep": None, "staging": None}


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
    options = dict(name=name, role="rollout", reliable=False, group=os.environ.get("TH_GROUP") or None,
                   engine=os.environ.get("TH_ENGINE") or None)
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
    if not callable(getattr(model, "load_weights", None)):
        raise BadArgument(f"model: {type(model).__name__} has no load_weights(iterable of (name, tensor))")
    with _lock:  # one update at a time per process: they share the staging memory
        if _state["ep"] is None:
            _state["ep"] = _connect()
        ep, staging = _state["ep"], _state["staging"]
        if staging is None:
            made: dict = {}

            def fresh(shards) -> dict:
                made.update(allocate_global(shards))
                return made

            got = ep.fetch(model_name, version, into=fresh, group=ep.info.group, timeout=timeout)
            _state["staging"] = staging = made
        else:
            got = ep.fetch(model_name, version, into=staging, group=ep.info.group, timeout=timeout)
        model.load_weights(iter(staging.items()))
        return got


def close(drain_timeout: float = 30.0) -> None:
    """Leave the cluster (at exit; tests call it): the staging copy is unpublished, with a
    drain of at most ``drain_timeout`` seconds."""
    with _lock:
        ep, _state["ep"], _state["staging"] = _state["ep"], None, None
    if ep is not None:
        ep.close(drain_timeout=drain_timeout)


atexit.register(close)
