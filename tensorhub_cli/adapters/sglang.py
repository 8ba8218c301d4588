"""SGLang's custom weight loader, backed by TensorHub:
``--custom-weight-loader tensorhub_cli.adapters.sglang.load``.

How SGLang calls it (read from sglang 0.5.23's code, the wheel ``pip download sglang``
fetches; SGLang is not installed or run here: it pins a CUDA build of torch and CUDA
kernels, and these machines are CPU-only). ``--custom-weight-loader`` only lists the
import paths a weight update may name; the startup load still reads ``--model-path``.
An update is ``begin_weight_update()`` (SGLang puts weights it packed in place back in
their loader form), ``update_weights_from_tensor(named_tensors,
load_format="tensorhub_cli.adapters.sglang.load")`` (HTTP: ``POST
/update_weights_from_tensor`` with that ``load_format``), ``end_weight_update()``
(SGLang's post-load steps). Every TP rank's ``WeightUpdater.update_weights_from_tensor``
deserializes its copy of ``named_tensors`` (a list of ``(name, tensor)``, moved to the
rank's device) and calls ``dynamic_import(load_format)(model, named_tensors)``, that
is ``load(model, named_tensors)`` here, on its scheduler thread, every rank at once
(the scheduler then waits on a barrier of the TP group). The return value is ignored;
an exception fails the update (SGLang then says the weights may be partly updated).

Protocol of ``load(model, named_tensors)``:

1. The version: ``named_tensors`` carries no weights here, only control: empty, or one
   entry ``("tensorhub.version", 0-d integer tensor)`` naming the version to load;
   without it, ``TH_VERSION`` (an int or ``latest``, the default). Any other entry is a
   ``BadArgument`` naming it, before anything is fetched: weights from two sources in
   one update would be ambiguous. In a TP instance rank 0 resolves the version
   (``latest``: the newest READY one) for every rank (``Endpoint.resolve``) and
   broadcasts the resolution over SGLang's TP group (its
   ``GroupCoordinator.broadcast_object``), so every rank loads one version (contract 2)
   without the hub's group round, which a shard reader never completes (it never
   holds every chunk), and the hub answers one resolve per instance. Outside an SGLang
   TP group the endpoint's group resolves it.
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
3. The path, chosen once, at the first fetch, from the version's manifest and the
   model (``layout.sglang_map``): where every parameter's weight loader maps (SGLang's
   unquantized layers: q/k/v and gate/up fused, TP slices, a padded vocabulary), the
   *shard* path: this rank reads only the boxes its parameters hold (contract 9) into
   a shadow of its parameters (on their device), then copies it into them in place.
   Otherwise (a quantized layer, a loader that changes the tensor, a ``load_weights``
   that bypasses loaders) the *whole* path, said once with why: the version by HF
   names into a host staging dict (``hf.allocate_global``), then
   ``model.load_weights(staging.items())``, whose loaders slice and fuse. A later
   version whose tensors differ from the map's is refused before a byte moves.
4. The sets (shadows or staging dicts), made at their first use. Until overwritten a
   set is a replica other readers may read from (a second server's rank of the same
   TP layout reads a shard from it). By default every version lands in the same set,
   so the endpoint unpublishes (drains) the previous version the moment the next
   fetch starts (contract 3). With ``TH_DOUBLE_BUFFER=1`` two sets alternate: v stays
   published while v+1 is fetched and loaded, and is unpublished (with its drain, and
   any retention copy the hub asks for first) only when v+2 needs its set. A version
   already in a set is not fetched again. ``last()``: the last load's path, bytes read
   and shard bytes (tests, logs).

What SGLang's contract does not allow: reading before the pause. The loader runs
inside ``update_weights_from_tensor``, generation already paused, and SGLang announces
nothing earlier; so the fetch is inside the pause here (vLLM's backend reads ahead).

Tested against stand-ins, not SGLang: ``tests/unit/test_adapter_sglang.py`` (a
transformers Llama behind a ``load_weights`` that copies by name: the whole path) and
``tests/unit/test_adapter_sglang_shard.py`` (``sglang_standin``: SGLang 0.5.23's loader
interfaces for its Llama, TP 2 ranks as processes: the shard path), with a real hub.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from typing import Iterable, Optional

from ..errors import BadArgument, LayoutError
from .agree import agree

log = logging.getLogger(__name__)

VERSION_KEY = "tensorhub.version"
_lock = threading.Lock()
# staging: the set the model was last loaded from; sets: every set (1, or 2 double-
# buffered: shadows on the shard path, staging dicts on the whole path), held: version
# -> index of the set holding it; path: None until the first fetch, then "shard" (map:
# its EngineMap) or "whole" (reason: why); last: the last load's figures
_FRESH = {"ep": None, "staging": None, "sets": [], "held": {}, "path": None, "map": None, "reason": None, "last": {}}
_state: dict = {k: (v.copy() if isinstance(v, (list, dict)) else v) for k, v in _FRESH.items()}


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


def _tp_group():
    """SGLang's TP group coordinator of this process when it has more than one rank;
    None outside SGLang (or at TP 1)."""
    try:
        from sglang.srt.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # (not in an SGLang scheduler process)
        return None
    return group if getattr(group, "world_size", 1) > 1 else None


def _agree(ep, model_name: str, version: int | str, group):
    """Rank 0's resolution of ``version`` for every rank of ``group`` (``agree``);
    ``version`` as it was where rank 0 had none to give, and outside a TP group."""
    if group is None:
        return version
    resolved = agree(ep, model_name, version, group)
    return version if resolved is None else resolved


def _choose(model, tensors: dict) -> None:
    """The path, once per process: shard where ``sglang_map`` maps the model, else whole."""
    from ..layout.engine_map import Unmapped
    from ..layout.sglang_map import derive

    try:
        _state["map"], _state["path"] = derive(model, tensors), "shard"
    except Unmapped as exc:
        _state["path"], _state["reason"] = "whole", str(exc)
        log.warning("tensorhub: %s falls back to whole tensors through load_weights (this rank reads the whole "
                    "model): %s", _state["ep"].name, exc)
    else:
        log.info("tensorhub: %s reads its shard (%d bytes) into a shadow", _state["ep"].name,
                 _state["map"].shard_bytes)


def load(model, named_tensors) -> int:
    """SGLang's custom weight loader: fetch the TensorHub version the environment (or
    ``named_tensors``) names, this rank's shard where the model maps (else by HF names
    through ``model.load_weights``), and put it into the model."""
    from ..layout.sglang_map import apply
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
    with _lock:  # one update at a time per process: they share the sets
        if _state["ep"] is None:
            _state["ep"] = _connect()
        ep, sets, held = _state["ep"], _state["sets"], _state["held"]
        version = _agree(ep, model_name, version, _tp_group())
        current = next((i for i, s in enumerate(sets) if s is _state["staging"]), None)
        chosen: dict = {}

        def target(shards):
            # Called only for a version no set holds: the set after the current one (the
            # same one with a single set), made at its first use. The endpoint unpublishes
            # what it held before a byte lands.
            tensors = {t.name: (tuple(t.global_shape or t.shape), t.dtype) for m in shards for t in m.tensors}
            if _state["path"] is None:
                _choose(model, tensors)
            emap = _state["map"]
            if emap is not None:
                problems = emap.check(tensors)
                if problems:
                    raise LayoutError(f"{model_name}: the version's tensors are not the model's", problems)
            i = 0 if current is None else (current + 1) % buffers
            if i == len(sets):
                sets.append(emap.allocate(next(model.parameters()).device) if emap is not None
                            else allocate_global(shards))
            chosen["i"] = i
            return emap.targets(sets[i]) if emap is not None else sets[i]

        got = ep.fetch(model_name, version, into=target, timeout=timeout)  # (`latest`: with the endpoint's group)
        fetched = dict(ep.last_fetch or {})
        if "i" in chosen:  # the set's old version was unpublished before the fetch
            for v in [v for v, i in held.items() if i == chosen["i"]]:
                del held[v]
            held[got] = chosen["i"]
        # (else the endpoint returned at once: it holds `got` complete, in the set it was
        # fetched into; an entry left by a failed fetch names a version it no longer holds)
        _state["staging"] = staging = sets[held[got]]
        if _state["map"] is not None:
            apply(model, _state["map"], staging)
        else:
            model.load_weights(iter(staging.items()))
        _state["last"] = {"version": got, "path": _state["path"], "bytes": fetched.get("bytes", 0),
                          "from_publishers": fetched.get("from_publishers", 0),
                          "shard_bytes": _state["map"].shard_bytes if _state["map"] is not None else None}
        return got


def last() -> dict:
    """The last load: version, path (``shard`` or ``whole``), bytes read, shard bytes."""
    return dict(_state["last"], reason=_state["reason"])


def close(drain_timeout: float = 30.0) -> None:
    """Leave the cluster (at exit; tests call it): the staging copy is unpublished, with a
    drain of at most ``drain_timeout`` seconds."""
    with _lock:
        ep = _state["ep"]
        _state.update({k: (v.copy() if isinstance(v, (list, dict)) else v) for k, v in _FRESH.items()})
    if ep is not None:
        ep.close(drain_timeout=drain_timeout)


atexit.register(close)
