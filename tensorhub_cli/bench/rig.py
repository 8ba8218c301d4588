"""What benchmarks (and the integration tests) run processes with: a hub in a
subprocess, and ``Driven`` processes that answer one JSON line per JSON line asked.

Every process started here is stopped by its PID on exit, whatever happened; every
wait has a timeout that names the process and shows the end of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..hub.client import HubUnreachable, wait_for_hub
from ..hub.mustering import MUSTER_S
from ..launch.procs import kill_child, stop_child


class RigError(Exception):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def hub(planner: str = "ros", expiry_s: float = 5.0, token: str | None = None, host: str = "127.0.0.1",
        prefix: list[str] | None = None, deltas: str = "remote", muster_s: float = MUSTER_S):
    """A hub process → (address, token); on loopback, or at ``host`` through ``prefix``
    (``HubProcess``); ``deltas``: its default delta mode (``hub.deltas``); ``muster_s``:
    its ``--muster-s`` (``hub.mustering``)."""
    with HubProcess(planner, expiry_s, token, host, prefix, deltas=deltas, muster_s=muster_s) as h:
        yield h.address, h.token


class Driven:
    """A child process that reads JSON lines on stdin and answers each with one line;
    its first line is a greeting. stderr goes to a temp file (a pipe nobody drains
    would block a chatty child). ``prefix`` runs it elsewhere, e.g. inside a testbed
    node (``nsenter …``)."""

    def __init__(self, name: str, argv: list[str], env: dict | None = None, cwd: str | None = None,
                 prefix: list[str] | None = None):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"th-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, *argv], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env={**os.environ, **(env or {})})
        self._lines: queue.Queue = queue.Queue()
        self._hello: dict | None = None  # read on first use, so that children start in parallel
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        # A thread, not select() on the pipe: readline() buffers ahead, and a line
        # already in Python's buffer never wakes select() again.
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def stderr(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def _line(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RigError(f"{self.name}: no answer within {timeout}s; its log ends:\n{self.stderr()}") from None
        if line is None:
            raise RigError(f"{self.name} exited ({self.proc.poll()}): {self.stderr()}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise RigError(f"{self.name} wrote a line that is not its protocol: {line[:200]!r}") from None

    @property
    def hello(self) -> dict:
        if self._hello is None:
            self._hello = self._line(120)
        return self._hello

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60) -> dict:
        self.hello  # noqa: B018 (the greeting comes first)
        return self._line(timeout)

    def ask(self, op: str, timeout: float = 60, **args) -> dict:
        self.send(op, **args)
        reply = self.recv(timeout)
        if reply.get("trace"):
            raise RigError(f"{self.name}: {op} raised {reply['type']}: {reply['error']}\n{reply['trace']}")
        return reply

    def kill(self) -> None:
        kill_child(self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("exit", drain_timeout=2)
                self.proc.wait(timeout=15)
            except Exception:
                pass
        stop_child(self.proc)
        self.log.close()
        os.unlink(self.log.name)


class HubProcess:
    """A hub process on loopback that can be killed (-9) and started again on the same
    address and token, as ``th up`` restarts a dead hub. Use it as a context manager:
    the process is stopped by its PID on exit, whatever happened."""

    def __init__(self, planner: str = "ros", expiry_s: float = 5.0, token: str | None = None,
                 host: str = "127.0.0.1", prefix: list[str] | None = None, deltas: str = "remote",
                 muster_s: float = MUSTER_S):
        """``host``/``prefix``: run it elsewhere, e.g. inside a testbed node (where the
        port is surely free)."""
        self.deltas, self.muster_s = deltas, muster_s
        self.token = token or secrets.token_hex(16)
        self.planner, self.expiry_s, self.prefix = planner, expiry_s, prefix
        self._tmp = tempfile.TemporaryDirectory(prefix="th-rig-")
        self.token_file = Path(self._tmp.name) / "token"
        self.token_file.write_text(self.token)
        self.address = f"tcp://{host}:{free_port() if prefix is None else 7790}"
        self.log = open(Path(self._tmp.name) / "hub.log", "a+b")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> None:
        self.proc = subprocess.Popen([*(self.prefix or []), sys.executable, "-m", "tensorhub_cli.hub", "--bind",
                                      self.address,
                                      "--token-file", str(self.token_file), "--expiry-s", str(self.expiry_s),
                                      "--planner", self.planner, "--deltas", self.deltas, "--muster-s",
                                      str(self.muster_s)], stdout=self.log, stderr=subprocess.STDOUT)
        proc = self.proc
        try:
            wait_for_hub(self.address, self.token, timeout=timeout, alive=lambda: proc.poll() is None)
        except HubUnreachable as exc:
            self.log.seek(0)
            raise RigError(f"hub: {exc}; its log:\n{self.log.read().decode(errors='replace')[-2000:]}") from None

    def kill(self) -> None:
        if self.proc is not None:
            kill_child(self.proc)

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc)
        self.log.close()
        self._tmp.cleanup()

    def __enter__(self) -> "HubProcess":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
