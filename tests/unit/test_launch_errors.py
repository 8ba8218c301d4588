"""A corrupt ``state.json`` and a signal racing a process's exit are one-line errors
naming the file or the process, never tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from tensorhub_cli.launch import procs
from tensorhub_cli.launch.procs import ProcRecord

from ..conftest import REPO


@pytest.mark.parametrize("argv", [["status", "-c", "broken"], ["down", "-c", "broken"], ["versions", "-c", "broken"],
                                  ["scale", "rollout+1", "-c", "broken"], ["logs", "node1", "-c", "broken"], ["down"]])
def test_a_corrupt_state_file_is_one_line_naming_it(th_home, argv):
    path = th_home / "broken" / "state.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"cluster": "broken", "procs": [')
    done = subprocess.run([sys.executable, "-m", "tensorhub_cli", *argv], capture_output=True, text=True, timeout=60,
                          env=os.environ.copy(), cwd=REPO)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "unreadable cluster state" in lines[0], done.stderr


def test_up_on_a_corrupt_state_file_is_one_line_naming_it(th_home, tmp_path):
    spec = (REPO / "specs" / "local.yaml").read_text().replace("name: demo", "name: broken")
    (tmp_path / "s.yaml").write_text(spec)
    path = th_home / "broken" / "state.json"
    path.parent.mkdir(parents=True)
    path.write_text("not json")
    done = subprocess.run([sys.executable, "-m", "tensorhub_cli", "up", str(tmp_path / "s.yaml")], capture_output=True,
                          text=True, timeout=60, env=os.environ.copy(), cwd=REPO)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and str(path) in done.stderr


class Vanishing:
    """A process that was ours when looked up and is gone (its PID taken by a process
    we may not signal) by the time the signal is sent."""

    pid = 4242

    def send_signal(self, sig):
        raise psutil.AccessDenied(self.pid)

    def kill(self):
        raise psutil.AccessDenied(self.pid)


def test_a_signal_racing_the_exit_is_an_outcome_naming_the_process(monkeypatch):
    monkeypatch.setattr(procs, "_ours", lambda rec: Vanishing())
    rec = ProcRecord(role="agent", node="node2", pid=4242, starttime=1, marker="m", log="")
    outcome = procs.stop(rec, timeout=0.1)
    assert outcome.startswith("unknown") and "agent on node2 (pid 4242)" in outcome and "\n" not in outcome


def test_child_helpers_survive_a_child_that_is_gone_or_not_ours(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        def refuse(pid, sig):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(procs, "inner_pid", lambda p: 1)  # e.g. an nsenter's child, its PID reused
        monkeypatch.setattr(procs.os, "kill", refuse)
        with pytest.raises(subprocess.TimeoutExpired):  # no traceback from the signal: only the wait's limit
            procs.kill_child(proc, timeout=0.1)
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait()


def test_preflight_names_the_live_process_on_the_hub_port_and_lets_time_wait_pass(tmp_path):
    """After `kill -9` of a hub, its port lingers in TIME_WAIT: that must pass. A port a
    live process listens on fails, naming the process (here: this test's own)."""
    import socket

    import yaml

    from tensorhub_cli.launch.local import LocalLauncher
    from tensorhub_cli.spec import load

    from .test_reconcile import time_wait_port

    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"][0]["address"] = "127.0.0.1"
    doc["hub"]["port"], doc["hub"]["metrics_port"] = time_wait_port(), None
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    assert LocalLauncher(load(tmp_path / "s.yaml"), tmp_path).preflight() == []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        doc["hub"]["port"] = listener.getsockname()[1]
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
        problems = LocalLauncher(load(tmp_path / "s.yaml"), tmp_path).preflight()
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"hub.port: cannot bind 127.0.0.1:{doc['hub']['port']}: in use by a live process: "
                                  f"pid {os.getpid()} (")
    assert "pytest" in problems[0] or "python" in problems[0]
