"""What the vLLM backend (``adapters.vllm``) is given: ``init_info`` and ``update_info``.

Protocol. ``InitInfo.parse(dict)`` and ``UpdateInfo.parse(dict)`` return frozen records
or raise ``ValueError`` naming the field at fault (``init_info.model``,
``update_info.timeout``, an unknown field, ...); see ``adapters.vllm`` for what each
field means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

FETCH_TIMEOUT_S = 120.0


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
