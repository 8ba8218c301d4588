"""Drive ``worker`` processes from a test (see ``tensorhub_cli.bench.rig.Driven``)."""

from __future__ import annotations

import time

from tensorhub_cli.bench.rig import Driven

from ..conftest import REPO


class Worker(Driven):
    def __init__(self, hub: str, token: str, name: str, engine: str = "nixl", env: dict | None = None,
                 extra: list[str] | None = None, prefix: list[str] | None = None):
        super().__init__(name, ["-m", "tests.integration.worker", "--hub", hub, "--token", token, "--name", name,
                                "--engine", engine, *(extra or [])], env=env, cwd=str(REPO), prefix=prefix)


def wait_until(predicate, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
