"""Which launcher runs a cluster's processes, and the flags every endpoint process gets.

``launcher_for(kind, spec, state_dir)`` returns the local, ssh or ray launcher (each:
start, alive, stop, logs by ``ProcRecord``); ``endpoint_timeout_args(spec)`` turns the
spec's ``endpoints`` limits into the flags agents and runners take, and
``ucx_net_devices_args(node)`` the node's ``ucx_net_devices`` into the flag by which
an agent or runner sets ``TH_UCX_NET_DEVICES`` in its own environment before its
engine starts (``engines.nixl_shim`` turns that into ``UCX_NET_DEVICES`` for the
process's GPU). A flag, not the launchers' environment, so that it reaches the process
the same way over ssh and locally, and shows in its command line. Both ``cluster``
(up, down, reconcile) and ``scale`` use them, so they live below both.
"""

from __future__ import annotations

from pathlib import Path

from ..spec import ClusterSpec, PlacedNode, load
from .local import LocalLauncher


class UpError(Exception):
    pass


def launcher_for(kind: str, spec: ClusterSpec | None, state_dir: Path, connect_timeout: float | None = None):
    """``spec`` may be None when only stopping recorded processes."""
    if kind == "local":
        return LocalLauncher(spec, state_dir)
    if kind == "ssh":
        from .ssh import SshLauncher

        return SshLauncher(spec or load(state_dir / "spec.yaml"), state_dir, connect_timeout)
    if kind == "ray":
        from .ray_launcher import RayLauncher

        return RayLauncher(spec, state_dir)
    raise UpError(f"launcher {kind!r} is unknown (known: local, ssh, ray)")


def endpoint_timeout_args(spec: ClusterSpec) -> list[str]:
    """The spec's ``endpoints`` limits as the flags agents and runners take."""
    e = spec.endpoints
    return ["--read-timeout-s", str(e.read_timeout_s), "--plan-timeout-s", str(e.plan_timeout_s),
            "--drain-timeout-s", str(e.drain_timeout_s)]


def ucx_net_devices_args(node: PlacedNode) -> list[str]:
    """``--ucx-net-devices VALUE`` for a process on ``node`` (none when the node does
    not set ``ucx_net_devices``): its device list, or the per-GPU entries joined by ``;``."""
    value = node.spec.ucx_net_devices
    if value is None:
        return []
    return ["--ucx-net-devices", value if isinstance(value, str) else ";".join(value)]
