"""Testbed tests: real namespaces, shaped links, sshd per node, `th up` over SSH.

They need root and network namespaces. Where those are missing they skip with the
reason printed, except under CI (``CI`` set), where a skip would hide a broken
testbed: there they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tensorhub_cli.bench.testbed import testbed, unavailable

from ..conftest import REPO

TH = [sys.executable, "-m", "tensorhub_cli.cli"]


def require_testbed() -> None:
    why = unavailable()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"testbed unavailable on CI: {why}")
    pytest.skip(f"testbed unavailable: {why}")


def th(*args: str, home: Path, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([*TH, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "TH_HOME": str(home)})
    if check and done.returncode != 0:
        raise AssertionError(f"th {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def status(home: Path, cluster: str) -> dict:
    return json.loads(th("status", "-c", cluster, "--json", home=home).stdout)


def leftovers() -> list[str]:
    """Anything of ours still alive: testbed namespaces, sshd or tensorhub processes."""
    found = [f"netns {line.split()[0]}" for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines() if line.startswith("thtb-")]
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())  # None where it cannot be read
        if "th-testbed" in cmd or "tensorhub_cli.agent" in cmd or "tensorhub_cli.hub" in cmd \
                or "tests.integration.worker" in cmd:
            found.append(f"pid {proc.info['pid']}: {cmd[:120]}")
    return found


@pytest.fixture(scope="module")
def built(request, tmp_path_factory):
    """``request.param``: the flags of ``scripts/testbed up`` (N first)."""
    require_testbed()
    nodes, *flags = request.param
    with testbed(nodes, *flags) as state:
        yield state
