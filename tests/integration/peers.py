"""Drive ``worker`` processes from a test: start, ask, kill — each bounded by a timeout."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from tensorhub_cli.launch.procs import stop_child

from ..conftest import REPO


class Worker:
    def __init__(self, hub: str, token: str, name: str, engine: str = "nixl", env: dict | None = None,
                 extra: list[str] | None = None):
        self.name = name
        # stderr goes to a file: a pipe nobody drains blocks a chatty process mid-test
        self.log = tempfile.NamedTemporaryFile(prefix=f"th-worker-{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.worker", "--hub", hub, "--token", token, "--name", name,
             "--engine", engine, *(extra or [])],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, **(env or {})})
        self._hello: dict | None = None  # read on first use, so workers start in parallel
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def hello(self) -> dict:
        if self._hello is None:
            self._hello = self._line(60)
        return self._hello

    def stderr(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-3000:]

    def send(self, op: str, **args) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60) -> dict:
        self.hello  # noqa: B018 (the greeting comes first)
        return self._line(timeout)

    def _line(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no answer within {timeout}s; its log ends:\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"{self.name} exited ({self.proc.poll()}): {self.stderr()}")
        return json.loads(line)

    def _pump(self) -> None:
        # A thread, not select() on the pipe: readline() buffers ahead, and a line
        # already in Python's buffer never wakes select() again.
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def ask(self, op: str, timeout: float = 60, **args) -> dict:
        self.send(op, **args)
        reply = self.recv(timeout)
        if reply.get("trace"):
            raise AssertionError(f"{self.name}: {op} raised {reply['type']}: {reply['error']}\n{reply['trace']}")
        return reply

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

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


def wait_until(predicate, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
