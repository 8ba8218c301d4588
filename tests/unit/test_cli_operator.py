"""What an operator sees when things go wrong (issue 31): a hub that is down, Ctrl-C
during `th sync`, NIXL's and UCX's own noise, and `th bench`'s testbed from a `th`
that runs with some other interpreter than the repository's .venv."""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tensorhub_cli.cli import app

from ..conftest import REPO
from .test_cli import fake_cluster  # noqa: F401 (a fixture)

runner = CliRunner()


# --- th status with the hub down --------------------------------------------------------


@pytest.fixture
def hub_down(th_home):
    """A recorded cluster whose hub process is gone (nothing listens at its address)
    and whose three agents run: real processes, recorded as `th up` records them."""
    from tensorhub_cli.launch.procs import ProcRecord, spawn, stop
    from tensorhub_cli.launch.state import ClusterState, cluster_dir, write_state, write_token

    agents = [spawn("agent", node, [sys.executable, "-c", "import time; time.sleep(120)", f"th-test-agent-{node}"],
                    th_home / f"{node}.log", f"th-test-agent-{node}") for node in ("node1", "node2", "node3")]
    hub = ProcRecord(role="hub", node="node1", pid=os.getpid(), starttime=1, marker="never-matches", log="")
    try:
        write_state(ClusterState(cluster="down", launcher="local", hub_address="tcp://127.0.0.1:9",
                                 hub_node_address="127.0.0.1", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0,
                                 procs=[hub, *agents]))
        write_token("down", None)
        (cluster_dir("down") / "spec.yaml").write_text((REPO / "specs" / "local.yaml").read_text())
        yield agents
    finally:
        for rec in agents:
            stop(rec, timeout=5)


def test_status_with_the_hub_down_says_so_shows_the_processes_and_the_fix(hub_down):
    result = runner.invoke(app, ["status", "-c", "down"])
    assert result.exit_code == 1
    out, err = result.stdout, result.stderr
    assert "down (no reply)" in out.splitlines()[0] and "(gone)" in out.splitlines()[0]
    for rec in hub_down:  # the agents run: the launcher says so, not "alive: no"
        row = next(line for line in out.splitlines() if f"agent-{rec.node}" in line)
        assert str(rec.pid) in row and "running" in row, out
    assert " no " not in out and "none yet" not in out, out  # no hub view passed off as the cluster's state
    assert "versions: not known while the hub is down" in " ".join(out.split())
    assert "the hub is down (its process is gone): `th up SPEC` restarts it" in err, err
    versions = runner.invoke(app, ["versions", "-c", "down"])
    assert versions.exit_code == 1 and "`th up SPEC` restarts it" in versions.stderr, versions.output


# --- Ctrl-C during th sync ----------------------------------------------------------------


def test_ctrl_c_during_sync_says_the_fetches_go_on_and_how_to_follow_them(fake_cluster, monkeypatch):
    from tensorhub_cli.launch import operate
    from tensorhub_cli.launch.operate import SyncRun, Target

    def interrupted_sync(client, model, version, role, node, timeout, on_update=lambda run: None, **kw):
        run = SyncRun(model=model, version=7, nbytes=2**30,
                      targets={"agent-node1": Target("agent-node1", held_bytes=2**30, done=True),
                               "agent-node2": Target("agent-node2", held_bytes=0),
                               "agent-node3": Target("agent-node3", held_bytes=2**28)})
        on_update(run)
        raise KeyboardInterrupt

    monkeypatch.setattr(operate, "sync", interrupted_sync)
    result = runner.invoke(app, ["sync", "big", "--role", "agent"])
    assert result.exit_code == 130, result.output
    text = " ".join(result.stderr.split())
    assert "th sync: interrupted: this command only watched; the targets go on fetching big@7 on their own" in text
    assert "agent-node2 0.0/1024.0 MiB, agent-node3 256.0/1024.0 MiB" in text and "agent-node1 0.0" not in text
    assert "`th status --watch` follows them" in text and "`th unpublish big 7 --node NODE`" in text


# --- NIXL's and UCX's own lines -------------------------------------------------------------

NOISY = """
import numpy as np
from tensorhub_cli.engines.nixl_shim import load_nixl
nixl = load_nixl()
agent = nixl.nixl_agent("noisy", nixl.nixl_agent_config(backends=["UCX"]))
buf = np.zeros(4096, dtype=np.uint8)
descs = agent.get_xfer_descs([(buf.ctypes.data, buf.nbytes, 0)], "DRAM")
try:
    agent.initialize_xfer("READ", descs, descs, "nobody")  # NIXL logs its own error line
except Exception as exc:
    print(type(exc).__name__)
"""


def _run_noisy(env: dict, terminal: bool, log) -> tuple[str, str]:
    """Run NOISY with stderr on a terminal (a pty) or in the file ``log``: (stdout, stderr)."""
    env = {k: v for k, v in {**os.environ, "PYTHONPATH": str(REPO), **env}.items()
           if v is not None and not (k in ("UCX_LOG_LEVEL", "NIXL_LOG_LEVEL", "TH_VERBOSE") and k not in env)}
    if not terminal:
        with open(log, "w") as f:
            done = subprocess.run([sys.executable, "-c", NOISY], stdout=subprocess.PIPE, stderr=f, text=True,
                                  env=env, timeout=120)
        return done.stdout, log.read_text()
    parent, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", NOISY], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=child, env=env)
    os.close(child)
    stdout = proc.stdout.read().decode()
    proc.wait(timeout=120)
    seen = b""
    try:
        while chunk := os.read(parent, 65536):
            seen += chunk
    except OSError:  # the pty's other end closed
        pass
    os.close(parent)
    return stdout, seen.decode(errors="replace")


def test_nixl_noise_stays_off_a_terminal_unless_asked_and_stays_in_logs(tmp_path):
    pytest.importorskip("numpy")
    clean = {"UCX_LOG_LEVEL": None, "NIXL_LOG_LEVEL": None, "TH_VERBOSE": None}
    stdout, terminal = _run_noisy(clean, True, None)
    assert stdout.strip() == "nixlNotFoundError"  # the failure still reaches the program
    assert "nixl_agent.cpp" not in terminal and "NIXL" not in terminal, terminal
    _, verbose = _run_noisy({**clean, "TH_VERBOSE": "1"}, True, None)
    assert "nixl_agent.cpp" in verbose, verbose  # asked for: shown
    _, logged = _run_noisy(clean, False, tmp_path / "runner.log")
    assert "nixl_agent.cpp" in logged, logged  # a log file keeps every line


def test_log_levels_are_set_only_for_a_terminal_and_never_over_the_users():
    from tensorhub_cli.engines.nixl_shim import log_environment

    assert log_environment({}, True) == {"UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "FATAL"}
    assert log_environment({}, False) == {}
    assert log_environment({"TH_VERBOSE": "1"}, True) == {}
    assert log_environment({"TH_VERBOSE": "0"}, True) != {}
    assert log_environment({"UCX_LOG_LEVEL": "warn"}, True) == {"NIXL_LOG_LEVEL": "FATAL"}


# --- the testbed from a th installed any other way -----------------------------------------


def test_the_testbed_runs_with_the_interpreter_that_runs_th(tmp_path, monkeypatch):
    """A checkout without .venv whose python3 lacks psutil (a `th` installed in some
    other environment): the kit must still run, with ours."""
    from tensorhub_cli.bench import testbed

    scripts = tmp_path / "checkout" / "scripts"
    shutil.copytree(REPO / "scripts", scripts, ignore=shutil.ignore_patterns("__pycache__"))
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text("#!/bin/sh\necho 'scripts/testbed needs psutil' >&2\nexit 1\n")
    (stub / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub}:{os.environ['PATH']}")
    monkeypatch.setenv("TH_TESTBED_DIR", str(tmp_path / "none"))  # no testbed recorded there
    monkeypatch.setattr(testbed, "SCRIPT", scripts / "testbed")
    with pytest.raises(testbed.TestbedError) as caught:
        testbed._script("status", timeout=60)  # status exits 1 when none is up: it ran
    assert "testbed: none is up" in str(caught.value) and "psutil" not in str(caught.value)
    assert testbed.enter("node1")[0] == sys.executable
