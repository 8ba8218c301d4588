"""Local process identity through psutil: a record names a process by PID, kernel
start time (clock ticks since boot, the number state.json and the ssh launcher hold)
and a command-line marker; stop signals only that process, within the limits given."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tensorhub_cli.launch import procs
from tensorhub_cli.launch.procs import ProcRecord, cpu_seconds, inner_pid, is_ours, spawn, start_ticks, stop, stop_child

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"


def kernel_starttime(pid: int) -> int:
    stat = open(f"/proc/{pid}/stat").read()  # the kernel's own number, to check ours against
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def wait_for(path, text: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.02)


@pytest.fixture
def sleeper(tmp_path):
    rec = spawn("agent", "n1", ["sleep", "31.5"], tmp_path / "sleep.log", marker="31.5")
    yield rec
    stop(rec, timeout=0.5)


def test_start_time_is_the_kernels_clock_ticks(sleeper):
    assert sleeper.starttime == kernel_starttime(sleeper.pid) == start_ticks(sleeper.pid)
    assert is_ours(sleeper)


def test_a_stepped_wall_clock_does_not_move_the_start_time(sleeper, monkeypatch):
    # btime (/proc/stat) is wall-clock: a step or a VM resume moves it between two reads.
    # Alternate it by a second on every read, the worst a stepping clock can do.
    import itertools
    import psutil._pslinux

    btimes = itertools.cycle([psutil.boot_time(), psutil.boot_time() + 1.0])
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: next(btimes))
    for _ in range(4):
        assert start_ticks(sleeper.pid) == kernel_starttime(sleeper.pid) == sleeper.starttime
        assert is_ours(sleeper)


def test_a_reused_pid_or_another_program_is_not_ours(sleeper):
    assert not is_ours(ProcRecord(**{**_fields(sleeper), "starttime": sleeper.starttime + 1}))
    assert not is_ours(ProcRecord(**{**_fields(sleeper), "marker": "tensorhub_cli.agent"}))
    assert stop(ProcRecord(**{**_fields(sleeper), "starttime": sleeper.starttime - 1})) == "not running"
    assert is_ours(sleeper)  # the stranger was left alone


def test_stop_terms_then_kills_within_the_limits_given(tmp_path, sleeper):
    assert stop(sleeper, timeout=5.0) == "stopped"
    assert not is_ours(sleeper) and stop(sleeper) == "not running"
    log = tmp_path / "stubborn.log"
    rec = spawn("agent", "n1", [sys.executable, "-c", IGNORES_TERM, "stubborn"], log, marker="stubborn")
    wait_for(log, "ready")
    t0 = time.monotonic()
    assert stop(rec, timeout=0.3, kill_timeout=5.0) == "killed"
    assert time.monotonic() - t0 < 4.0
    assert not is_ours(rec)


def test_cpu_seconds_and_a_missing_process():
    t0 = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) >= t0 + 0.1
    if os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"):
        # Finer than a clock tick (10 ms): a hub phase of a few ms is not read as 0.
        t0 = cpu_seconds(os.getpid())
        deadline = time.process_time() + 0.003
        while time.process_time() < deadline:
            pass
        assert 0.002 < cpu_seconds(os.getpid()) - t0 < 1.0
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(ProcessLookupError):
        cpu_seconds(gone.pid)


def test_child_helpers_honour_their_timeout():
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_TERM], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert inner_pid(proc) == proc.pid  # not an nsenter: the process itself
    t0 = time.monotonic()
    stop_child(proc, timeout=0.3)  # TERM is ignored: SIGKILL after 0.3 s
    assert proc.returncode == -9 and time.monotonic() - t0 < 3.0
    proc.stdout.close()


def test_a_process_that_exits_at_once_is_reported(tmp_path, monkeypatch):
    def gone(pid):
        raise procs.psutil.NoSuchProcess(pid)

    monkeypatch.setattr(procs, "start_ticks", gone)
    with pytest.raises(RuntimeError, match="exited at once"):
        spawn("hub", "n1", ["true", "marker"], tmp_path / "hub.log", marker="marker")


def _fields(rec: ProcRecord) -> dict:
    return {f: getattr(rec, f) for f in rec.__struct_fields__}
