"""Processes started on this machine, identified by more than their PID.

Protocol: ``spawn`` starts a detached process (own session, stdin closed, output to a
log file) and returns a ``ProcRecord``. A record names a process by PID *and* kernel
start time *and* a marker in its command line, so ``is_ours`` is false once the PID has
been reused by anything else, and ``stop`` can never signal a stranger.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import msgspec


class ProcRecord(msgspec.Struct):
    role: str  # "hub" or "agent"
    node: str
    pid: int
    starttime: int  # clock ticks since boot, field 22 of /proc/PID/stat
    marker: str  # a string that must appear in /proc/PID/cmdline
    log: str


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (index 0 is field 3), or None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces or parentheses; fields after the last ')' are fixed.
    return stat[stat.rindex(")") + 2 :].split()


def _starttime(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (fields 14 and 15)."""
    fields = _stat(pid)
    if fields is None:
        raise ProcessLookupError(f"no process {pid}")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def is_ours(rec: ProcRecord) -> bool:
    start = _starttime(rec.pid)
    return start is not None and start == rec.starttime and rec.marker in _cmdline(rec.pid) and not _is_zombie(rec.pid)


def spawn(role: str, node: str, argv: list[str], log: Path, marker: str, env: dict[str, str] | None = None) -> ProcRecord:
    """``marker`` must be one of ``argv``; it is how ``is_ours`` recognises the process later."""
    assert marker in argv
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives `th up` exiting and the terminal closing
            env={**os.environ, **(env or {})},
            close_fds=True,
        )
    start = _starttime(proc.pid)
    if start is None:
        raise RuntimeError(f"{role} on {node} exited at once; see {log}")
    # Popen keeps a handle to reap the child; `th up` exits soon and init reaps it then.
    return ProcRecord(role=role, node=node, pid=proc.pid, starttime=start, marker=marker, log=str(log))


def stop(rec: ProcRecord, timeout: float = 5.0) -> str:
    """SIGTERM, then SIGKILL after ``timeout``. Returns what happened, for the user."""
    if not is_ours(rec):
        return "not running"
    os.kill(rec.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(rec.pid)
        if not is_ours(rec):
            return "stopped"
        time.sleep(0.05)
    os.kill(rec.pid, signal.SIGKILL)
    for _ in range(100):
        _reap(rec.pid)
        if not is_ours(rec):
            return "killed"
        time.sleep(0.02)
    return "would not die"


def stop_child(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a child this process started and still holds (so its PID cannot have been
    reused): SIGTERM, SIGKILL after ``timeout``, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child (normal: `th up` already exited): init reaps it


def log_tail(path: str | Path, lines: int = 8) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"
