"""Local launcher: every node is a loopback address of this machine.

Each hub/agent is a detached process of this machine's Python (or the node's
``bootstrap.python``) that binds, or connects from, its node's 127.x address.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from ..spec import ClusterSpec, PlacedNode
from .procs import ProcRecord, is_ours, spawn, stop


class LocalLauncher:
    def __init__(self, spec: ClusterSpec | None, state_dir: Path):
        self.spec = spec
        self.state_dir = state_dir

    def _python(self, node: PlacedNode) -> str:
        boot = node.spec.bootstrap
        return boot.python if boot and boot.python else sys.executable

    def preflight(self) -> list[str]:
        """Problems that would make the start fail, found before anything starts."""
        hub = self.spec.node(self.spec.hub.node)
        problems = []
        for what, port in (("hub.port", self.spec.hub.port), ("hub.metrics_port", self.spec.hub.metrics_port)):
            if port is None:
                continue
            with socket.socket() as s:
                try:
                    s.bind((hub.spec.address, port))
                except OSError as exc:
                    problems.append(f"{what}: cannot bind {hub.spec.address}:{port}: {exc.strerror}")
        return problems

    def start(self, node: PlacedNode, role: str, module: str, args: list[str]) -> ProcRecord:
        argv = [self._python(node), "-m", module, *args]
        log = self.state_dir / "logs" / f"{role}-{node.name}.log"
        return spawn(role, node.name, argv, log, marker=module)

    def alive(self, rec: ProcRecord) -> bool:
        return is_ours(rec)

    def stop(self, rec: ProcRecord) -> str:
        return stop(rec)
