"""The client library trainers and rollout engines link: ``connect`` → ``Endpoint``.

This package takes explicit addresses only: it reads no cluster state and no spec
(``tensorhub_cli.api.connect`` adds ``connect(cluster=...)`` on top, through
``launch.lookup``). ``connect`` checks its arguments (``BadArgument`` naming the one at
fault), then registers with the hub before it returns; see ``endpoint`` for the
publish/fetch/unpublish protocol, ``commands`` for the hub's commands and the
``on_command`` hook, ``tensorhub_cli.errors`` for what each call may raise.
"""

from __future__ import annotations

import os
import sys
from typing import Literal, Optional

from ..errors import BadArgument, TensorHubError, TensorHubTimeout, VersionNotFound, VersionTimeout
from ..hub import protocol as p
from ..layout import LayoutError
from . import checks
from .commands import CommandHandler, SyncCommands
from .endpoint import Endpoint, EndpointError
from .fetch import FetchError

__all__ = ["connect", "BadArgument", "CommandHandler", "Endpoint", "EndpointError", "FetchError", "LayoutError",
           "SyncCommands", "TensorHubError", "TensorHubTimeout", "VersionNotFound", "VersionTimeout"]

# Endpoint keywords connect passes on only when given (None: the Endpoint's default).
_SECONDS = ("heartbeat_s", "read_timeout_s", "plan_timeout_s", "drain_timeout_s", "call_timeout_s",
            "connect_timeout", "peer_idle_s", "conn_idle_s")
_SIZES = ("chunk_bytes", "small_bytes")


def _text(value: object, what: str, *, empty: bool = False) -> str:
    if isinstance(value, str) and (empty or value):
        return value
    raise BadArgument(f"{what} takes a{'' if empty else ' non-empty'} str, not {value!r}")


def _one_of(value: object, what: str, allowed: tuple) -> object:
    if value not in allowed:
        raise BadArgument(f"{what} takes one of {', '.join(map(repr, allowed))}, not {value!r}")
    return value


def _device(value: object) -> Optional[int]:
    """``device=`` as an index: None (not said), -1 (host memory) or N (CUDA device N).
    Takes "cpu", "cuda:N", "cuda" (the current CUDA device), an int N >= 0 or a
    ``torch.device``."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise BadArgument(f"device takes a CUDA device index >= 0 (or 'cpu'), not {value}")
        return value
    torch = sys.modules.get("torch")  # (a torch.device means torch is loaded; never load it for a str)
    text = str(value) if isinstance(value, str) or (torch is not None and isinstance(value, torch.device)) else None
    if text == "cpu":
        return -1
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BadArgument("device='cuda' names the current CUDA device, but CUDA is not available here")
        return torch.cuda.current_device()
    if text is not None and text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise BadArgument(f"device takes 'cpu', 'cuda', 'cuda:N', an index N or a torch.device, not {value!r}")


def _tier(tier: object, device: Optional[int]) -> str:
    """The tier we register with: the one given, else the device's (GPU memory is
    tier "device", host memory "host"; neither said: "host"). A tier contradicting
    the device is refused rather than registered wrong."""
    if tier is None:
        return "device" if device is not None and device >= 0 else "host"
    _one_of(tier, "tier", ("device", "host"))
    if device is not None and (tier == "device") != (device >= 0):
        where = "host memory" if device < 0 else f"cuda:{device}"
        raise BadArgument(f"tier={tier!r} contradicts device={where!r}: memory on a GPU is tier 'device', "
                          "host memory tier 'host' (leave tier out to take the device's)")
    return tier


def connect(hub: str, token: Optional[str] = None, *, name: str, node: Optional[str] = None, role: str = "",
            reliable: bool = True, group: Optional[str] = None, tier: Optional[Literal["device", "host"]] = None,
            device: object = None, engine: Optional[str] = None, host: Optional[str] = None, dc: str = "",
            rack: str = "",
            heartbeat_s: Optional[float] = None, kind: Literal["endpoint", "agent"] = "endpoint",
            read_timeout_s: Optional[float] = None, plan_timeout_s: Optional[float] = None,
            drain_timeout_s: Optional[float] = None, call_timeout_s: Optional[float] = None,
            connect_timeout: Optional[float] = None, on_command: Optional[CommandHandler] = None,
            chunk_bytes: Optional[int] = None, small_bytes: Optional[int] = None,
            peer_idle_s: Optional[float] = None, conn_idle_s: Optional[float] = None,
            reg_cache_bytes: Optional[int] = None, schedule: Optional[bool] = None) -> Endpoint:
    """Join the cluster whose hub is at ``hub`` ("tcp://HOST:PORT") as endpoint ``name``.

    ``host`` is the address we bind and send from (default 127.0.0.1); ``engine``
    defaults to nixl. ``device`` is where the tensors we publish and fetch live ("cpu",
    "cuda:N", N or a ``torch.device``); ``tier`` (what the hub counts our copies as)
    follows it when left None: "device" for a CUDA device, else "host"; a tier that
    contradicts the device is a ``BadArgument``. Every timeout and size left None
    takes the ``Endpoint`` default (see ``tensorhub_cli.connect`` for each). Raises ``BadArgument`` naming a
    bad argument, ``EndpointError`` when the hub does not accept the registration
    within ``connect_timeout``."""
    if token is None:
        raise BadArgument("connect(hub=...) needs token=...")
    hub, token, name = _text(hub, "hub"), _text(token, "token"), _text(name, "name")
    for what, value in (("node", node), ("host", host), ("engine", engine)):
        if value is not None:
            _text(value, what)
    for what, value in (("role", role), ("dc", dc), ("rack", rack)):
        _text(value, what, empty=True)
    tier = _tier(tier, _device(device))
    _one_of(kind, "kind", ("endpoint", "agent"))
    _one_of(engine, "engine", (None, "nixl", "tcp"))
    _one_of(reliable, "reliable", (True, False))
    group = checks.group(group)
    if on_command is not None and not callable(on_command):
        raise BadArgument(f"on_command takes a callable (endpoint, command), not {type(on_command).__name__}")
    given = dict(heartbeat_s=heartbeat_s, read_timeout_s=read_timeout_s, plan_timeout_s=plan_timeout_s,
                 drain_timeout_s=drain_timeout_s, call_timeout_s=call_timeout_s, connect_timeout=connect_timeout,
                 peer_idle_s=peer_idle_s, conn_idle_s=conn_idle_s, chunk_bytes=chunk_bytes, small_bytes=small_bytes)
    options = {k: checks.seconds(v, k) if k in _SECONDS else checks.count(v, k)
               for k, v in given.items() if v is not None}
    if reg_cache_bytes is not None:  # (0 turns the cache off; the Endpoint checks it)
        options["reg_cache_bytes"] = reg_cache_bytes
    if schedule is not None:
        _one_of(schedule, "schedule", (True, False))
        options["schedule"] = schedule
    info = p.EndpointInfo(name=name, node=node or "local", dc=dc, rack=rack, role=role, kind=kind,
                          reliable=reliable, tier=tier, group=group, pid=os.getpid())
    return Endpoint(hub, token, info, host=host or "127.0.0.1", engine=engine or "nixl", on_command=on_command,
                    **options)
