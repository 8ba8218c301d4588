"""Argument checks for the endpoint's public calls: each returns the value it accepts,
or raises ``BadArgument`` whose one-line message names the argument at fault and what
it takes. They run before a call changes anything, so a refused call changed nothing.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

from ..errors import BadArgument
from ..hub import protocol as p
from ..names import check_model


def model(value: object, what: str = "model") -> str:
    return check_model(value, what)


def version(value: object, what: str = "version", *, latest: bool = False) -> Optional[int]:
    """A version number (an int >= 1), or None for ``"latest"`` where ``latest`` is allowed."""
    if latest and value == "latest":
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    takes = 'an int >= 1 or "latest"' if latest else "an int >= 1"
    raise BadArgument(f"{what} takes {takes}, not {value!r}")


def seconds(value: object, what: str, *, zero: bool = False) -> float:
    """A finite number of seconds, > 0 (>= 0 where ``zero``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
            value > 0 or (zero and value == 0)):
        return float(value)
    raise BadArgument(f"{what} takes a finite number of seconds {'>= 0' if zero else '> 0'}, not {value!r}")


def optional_seconds(value: object, what: str) -> Optional[float]:
    return None if value is None else seconds(value, what)


def count(value: object, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise BadArgument(f"{what} takes an int >= 1, not {value!r}")


def state_dict(value: object, what: str = "state_dict") -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise BadArgument(f"{what} takes a state_dict (a dict of name -> tensor), not {type(value).__name__}")
    return value


def into(value: object, what: str = "into") -> dict | Callable:
    if callable(value):
        return value
    if isinstance(value, dict):
        return state_dict(value, what)
    raise BadArgument(f"{what} takes a state_dict (name -> tensor) or a callable making one from the manifests, "
                      f"not {type(value).__name__}")


def shard(value: object) -> tuple[int, int]:
    """``(rank, world)`` with ``0 <= rank < world``."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value) and 0 <= value[0] < value[1]:
        return value[0], value[1]
    raise BadArgument(f"shard takes (rank, world) with 0 <= rank < world, not {value!r}")


def group(value: object) -> Optional[str]:
    if value is None or (isinstance(value, str) and value):
        return value
    raise BadArgument(f"group takes a non-empty str or None, not {value!r}")


def resolution(value: object, model_: str, what: str = "version") -> Optional[p.Resolved]:
    """A version another member resolved (``Endpoint.resolve``) for ``model_``, or None
    where ``value`` names a version instead."""
    if not isinstance(value, p.Resolved):
        return None
    if value.model != model_:
        raise BadArgument(f"{what} is a resolution of {value.model}@{value.version}, not of {model_!r}")
    if not value.shards:
        raise BadArgument(f"{what} is a resolution of {value.model}@{value.version} without its manifests; "
                          "pass one Endpoint.resolve returned")
    return value


class FetchArgs(NamedTuple):
    model: str
    number: Optional[int]  # None: latest
    resolved: Optional[p.Resolved]  # a resolution passed as the version: no resolve of ours
    into: dict | Callable
    group: Optional[str]
    timeout: float
    window: int
    read_timeout: Optional[float]
    plan_timeout: Optional[float]
    resolve_timeout: float


def fetch_args(model_: object, version_: object, into_: object, group_: object, timeout: object, window: object,
               read_timeout: object, plan_timeout: object, resolve_timeout: object) -> FetchArgs:
    """``Endpoint.fetch``'s arguments (a collective fetch's too), each checked."""
    name = model(model_)
    resolved = resolution(version_, name)
    number = resolved.version if resolved is not None else version(version_, latest=True)
    return FetchArgs(name, number, resolved, into(into_), group(group_),
                     seconds(timeout, "timeout"), count(window, "window"),
                     optional_seconds(read_timeout, "read_timeout"), optional_seconds(plan_timeout, "plan_timeout"),
                     seconds(resolve_timeout, "resolve_timeout"))
