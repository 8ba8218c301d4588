"""A runner's supervisor (``agent.supervise``) as real processes, with a real hub."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tensorhub_cli.agent.supervise import outcome_of
from tensorhub_cli.bench.rig import HubProcess
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient

from .peers import wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def supervise(tmp_path, *opts: str, runner: list[str]) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "runner.log"
    out = open(log, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "tensorhub_cli.agent.supervise", "--name", "flaky", *opts, "--",
                             "tests.integration.flaky", "--counter", str(tmp_path / "starts"), *runner],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    return proc, log


def starts(tmp_path) -> list[list[str]]:
    path = tmp_path / "starts"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def outcome(log: Path, pid: int) -> dict:
    record = outcome_of(log.read_text(), pid)
    assert record is not None, log.read_text()
    assert record.pop("pid") == pid
    return record


@pytest.fixture
def hub():
    with HubProcess(expiry_s=60.0) as h:  # far longer than the test: only a deregistration frees the name
        yield h


def test_a_crashed_runner_is_deregistered_at_once_and_restarted_under_a_new_incarnation(tmp_path, hub):
    at_hub = ["--hub", hub.address, "--token-file", str(hub.token_file)]
    proc, log = supervise(tmp_path, "--backoff-s", "0.1", *at_hub, runner=["--fail-times", "1", "--name", "flaky",
                                                                           *at_hub])
    client = HubClient(hub.address, hub.token)
    try:
        def registered_twice():
            return log.read_text().count("registered flaky incarnation") == 2 and len(starts(tmp_path)) == 2
        # Without the supervisor's Deregister the second start is refused (`conflict`) until
        # the first expires, 60 s from now.
        wait_until(registered_twice, 30, "the restarted runner to register", every=0.1)
        (_, first), (pid, second) = starts(tmp_path)
        assert first != second and "deregistered the dead runner at the hub" in log.read_text()
        ep = next(e for e in client.call(p.Status(), timeout=5).endpoints if e.name == "flaky")
        assert ep.alive and ep.pid == int(pid)

        os.kill(proc.pid, signal.SIGTERM)  # leave: passed on, not restarted
        assert proc.wait(timeout=20) == 0
        assert outcome(log, proc.pid) == {"outcome": "left", "exit": 0, "restarts": 1}
        assert len(starts(tmp_path)) == 2 and not psutil.pid_exists(int(pid))
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_restarts_stop_at_max_restarts_and_a_clean_exit_is_finished(tmp_path):
    proc, log = supervise(tmp_path, "--backoff-s", "0.05", "--max-restarts", "2",
                          runner=["--fail-times", "9", "--code", "3"])
    assert proc.wait(timeout=30) == 3
    assert outcome(log, proc.pid) == {"outcome": "gave_up", "exit": 3, "restarts": 2} and len(starts(tmp_path)) == 3

    other = tmp_path / "finish"
    other.mkdir()
    proc, log = supervise(other, "--backoff-s", "0.05", runner=["--fail-times", "1", "--finish"])
    assert proc.wait(timeout=30) == 0
    assert outcome(log, proc.pid) == {"outcome": "finished", "exit": 0, "restarts": 1} and len(starts(other)) == 2


def test_a_supervisor_killed_with_sigkill_takes_its_runner_along(tmp_path):
    proc, log = supervise(tmp_path, runner=[])
    pid = int(wait_until(lambda: starts(tmp_path), 20, "the runner to start", every=0.05)[0][0])
    assert psutil.pid_exists(pid)
    proc.kill()
    proc.wait(5)
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10,
               f"runner pid {pid} to die with its supervisor")


def th(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "tensorhub_cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_th_up_starts_a_roles_count_supervised_and_forgets_a_runner_that_finished(th_home, local_spec, tmp_path):
    import yaml

    doc = yaml.safe_load(local_spec.read_text())
    name = doc["name"]
    doc["roles"]["rollout"].update(count=1, restart={"backoff_s": 0.1}, runner={
        "command": "tests.integration.flaky", "args": ["--counter", str(tmp_path / "starts")]})
    local_spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    up = th("up", str(local_spec))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "started rollout-node2" in up.stdout
        (first, _), = starts(tmp_path)

        def registered_pid():
            st = json.loads(th("status", "-c", name, "--json").stdout)["status"]["endpoints"]
            return next((e["pid"] for e in st if e["name"] == "rollout-node2" and e["alive"]), None)
        assert registered_pid() == int(first)

        os.kill(int(first), signal.SIGKILL)  # the runner, not its supervisor: restarted in place
        pid = wait_until(lambda: registered_pid() not in (None, int(first)) and registered_pid(), 30,
                         "the supervisor to restart the killed runner")
        assert [s[0] for s in starts(tmp_path)] == [first, str(pid)]

        os.kill(pid, signal.SIGTERM)  # it finishes cleanly: on-failure leaves it, `th up` forgets it
        wait_until(lambda: "forgot" in (again := th("up", str(local_spec))).stdout and again, 30,
                   "th up to see the runner finished")
        assert len(starts(tmp_path)) == 2  # not restarted
        procs = json.loads(th("status", "-c", name, "--json").stdout)["processes"]
        assert not [p for p in procs if p["role"] == "rollout"]
    finally:
        down = th("down", "-c", name)
        assert down.returncode == 0, down.stdout + down.stderr


def test_th_up_restarts_a_runner_whose_supervisor_gave_up(th_home, local_spec, tmp_path):
    """The log file outlives restarts: the old supervisor's "runner exited" lines and
    outcome must not fail the new one's start, nor make `th up` take it for finished."""
    import yaml

    doc = yaml.safe_load(local_spec.read_text())
    name = doc["name"]
    doc["roles"]["rollout"].update(count=1, restart={"backoff_s": 0.1, "max_restarts": 1}, runner={
        "command": "tests.integration.flaky",
        "args": ["--counter", str(tmp_path / "starts"), "--fail-times", "2", "--crash-after-s", "1.5"]})
    local_spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        up = th("up", str(local_spec))
        assert up.returncode == 0, up.stdout + up.stderr
        log = next(p for p in (th_home / name / "logs").iterdir() if p.name.startswith("rollout-node2"))
        wait_until(lambda: '"outcome": "gave_up"' in log.read_text(), 30, "the supervisor to give up")
        assert len(starts(tmp_path)) == 2
        again = th("up", str(local_spec))  # the third start lives: fail-times 2
        assert again.returncode == 0, again.stdout + again.stderr
        assert "restarted rollout-node2" in again.stdout and "forgot" not in again.stdout
        assert len(starts(tmp_path)) == 3
    finally:
        down = th("down", "-c", name)
        assert down.returncode == 0, down.stdout + down.stderr
