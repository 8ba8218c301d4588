"""Local launcher: every node is a loopback address of this machine.

Each hub/agent is a detached process of this machine's Python (or the node's
``bootstrap.python``) that binds, or connects from, its node's 127.x address.
Stopping waits at most the ``timeout`` and ``kill_timeout`` each call gives
(``procs.stop``); ``logs --follow`` polls the file until the caller is interrupted.

Pre-flight: the hub's ports are bound once, with SO_REUSEADDR as the hub's own
listeners do, so the TIME_WAIT sockets a killed hub leaves pass; a port a live
socket holds fails, naming the process psutil finds on it (pid and command line; a
leftover hub's cluster, with the `th down` that stops it).
"""

from __future__ import annotations

import errno
import shutil
import socket
import sys
import time
from pathlib import Path

import psutil

from ..spec import ClusterSpec, PlacedNode
from .procs import KILL_TIMEOUT_S, STOP_TIMEOUT_S, ProcRecord, is_ours, log_tail, spawn, stop


def holder(address: str, port: int) -> str:
    """Who holds ``address:port`` (not in TIME_WAIT), as far as psutil can see: a
    listener first, then any other socket bound there."""
    try:
        conns = [c for c in psutil.net_connections(kind="inet") if c.laddr and c.laddr.port == port
                 and c.laddr.ip in (address, "0.0.0.0", "::") and c.status != psutil.CONN_TIME_WAIT]
    except (psutil.Error, OSError):
        return "a process psutil cannot list sockets for here"
    conns.sort(key=lambda c: c.status != psutil.CONN_LISTEN)
    if not conns:
        return "a socket that was gone when looked for (try again)"
    pid = conns[0].pid
    if pid is None:
        return "a process of another user (its pid is hidden from us)"
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return f"pid {pid}"
    who = f"pid {pid} ({' '.join(cmdline)[:160]})"
    if "tensorhub_cli.hub" in cmdline and "--cluster" in cmdline[:-1]:
        name = cmdline[cmdline.index("--cluster") + 1]
        who += f", the hub of cluster {name!r}: `th down -c {name}` stops it"
    return who


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
                    who = holder(hub.spec.address, port) if exc.errno == errno.EADDRINUSE else None
                    problems.append(f"{what}: cannot bind {hub.spec.address}:{port}: "
                                    + (f"in use by a live process: {who}" if who else exc.strerror))
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

    def remove_tree(self, node: str, path: str) -> None:
        """Delete ``path`` on ``node`` (what a dead process left behind), if it exists."""
        shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        pass
