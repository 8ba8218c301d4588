"""Local launcher: every node is a loopback address of this machine.

Each hub/agent is a detached process of this machine's Python (or the node's
``bootstrap.python``) that binds, or connects from, its node's 127.x address.
Stopping waits at most the ``timeout`` and ``kill_timeout`` each call gives
(``procs.stop``); ``logs --follow`` polls the file until the caller is interrupted.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from ..spec import ClusterSpec, PlacedNode
from .procs import KILL_TIMEOUT_S, STOP_TIMEOUT_S, ProcRecord, is_ours, log_tail, spawn, stop


class LocalLauncher:
    parallel = 4

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
                # As the hub's own listeners do: a killed hub's TIME_WAIT sockets must not
                # block its restart; a socket still listening there does.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((hub.spec.address, port))
                except OSError as exc:
                    problems.append(f"{what}: cannot bind {hub.spec.address}:{port}: {exc.strerror}")
        return problems

    def token_path(self, node: PlacedNode, token: str) -> str:
        return str(self.state_dir / "token")  # written by `up`; every process here shares it

    def start(self, node: PlacedNode, role: str, module: str, args: list[str], name: str | None = None) -> ProcRecord:
        """``name``: the process's own name (a runner's endpoint name) for its log
        file; default ``ROLE-NODE``."""
        argv = [self._python(node), "-m", module, *args]
        log = self.state_dir / "logs" / f"{name or f'{role}-{node.name}'}.log"
        return spawn(role, node.name, argv, log, marker=module)

    def alive(self, rec: ProcRecord) -> bool:
        return is_ours(rec)

    def stop(self, rec: ProcRecord, timeout: float = STOP_TIMEOUT_S, sig: str = "TERM",
             kill_timeout: float = KILL_TIMEOUT_S) -> str:
        return stop(rec, timeout, sig, kill_timeout)

    def log_tail(self, rec: ProcRecord, lines: int = 8) -> str:
        return log_tail(rec.log, lines)

    def logs(self, rec: ProcRecord, lines: int, follow: bool, write) -> None:
        path = Path(rec.log)
        text = path.read_text(errors="replace").splitlines(keepends=True) if path.exists() else []
        write("".join(text[-lines:]))
        if not follow:
            return
        offset = path.stat().st_size if path.exists() else 0
        while True:
            if path.exists() and path.stat().st_size > offset:
                with open(path, errors="replace") as f:
                    f.seek(offset)
                    write(f.read())
                    offset = f.tell()
            time.sleep(0.2)

    def close(self) -> None:
        pass
