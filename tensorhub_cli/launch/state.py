"""A running cluster's state on disk: ``$TH_HOME/<cluster>/`` (default ``~/.tensorhub``).

Layout: ``spec.yaml`` (the spec as started), ``token`` (mode 0600), ``state.json``
(hub address, ports, one ``ProcRecord`` per process), ``logs/<role>-<node>.log``.
``state.json`` is rewritten atomically after every process start, so an interrupted
``th up`` still leaves a record ``th down`` can clean up from. ``$TH_HOME/last``
names the cluster ``-c`` defaults to.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import msgspec

from ..tokens import write_token_file
from .procs import ProcRecord


class ClusterState(msgspec.Struct):
    cluster: str
    launcher: str
    hub_address: str  # tcp://ADDR:PORT
    hub_node_address: str
    metrics_port: int | None
    heartbeat_s: float
    expiry_s: float
    procs: list[ProcRecord] = []


class StateError(RuntimeError):
    """``state.json`` cannot be read; the message names the file and what to do."""


def th_home() -> Path:
    return Path(os.environ.get("TH_HOME") or Path.home() / ".tensorhub").expanduser()


def cluster_dir(name: str) -> Path:
    return th_home() / name


def write_state(state: ClusterState) -> None:
    d = cluster_dir(state.cluster)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "state.json.tmp"
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, d / "state.json")
    (th_home() / "last").write_text(state.cluster)


def read_state(name: str) -> ClusterState | None:
    path = cluster_dir(name) / "state.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterState)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StateError(f"{path}: unreadable cluster state ({exc}); remove it after checking that no process "
                         "of the cluster runs") from None


def clear_state(name: str) -> None:
    (cluster_dir(name) / "state.json").unlink(missing_ok=True)


def pick_cluster(name: str | None) -> str:
    """``-c NAME``, else the only cluster with state, else the last one started."""
    if name:
        return name
    home = th_home()
    running = sorted(p.parent.name for p in home.glob("*/state.json")) if home.is_dir() else []
    if len(running) == 1:
        return running[0]
    last = home / "last"
    if last.is_file() and last.read_text().strip() in running:
        return last.read_text().strip()
    if not running:
        raise LookupError(f"no cluster is running under {home} (start one with `th up FILE`)")
    raise LookupError(f"several clusters under {home}: {', '.join(running)}; pick one with -c NAME")


def write_token(name: str, token: str | None) -> Path:
    """Store the cluster token (given, or freshly generated) readable by us alone."""
    return write_token_file(cluster_dir(name) / "token", token or secrets.token_urlsafe(32))


def read_token(name: str) -> str:
    return (cluster_dir(name) / "token").read_text().strip()
