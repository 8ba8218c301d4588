"""Processes started on this machine, identified by more than their PID.

Protocol: ``spawn`` starts a detached process (own session, stdin closed, output to a
log file) and returns a ``ProcRecord``. A record names a process by PID *and* kernel
start time *and* a marker in its command line, so ``is_ours`` is false once the PID has
been reused by anything else, and ``stop`` can never signal a stranger.
"""

from __future__ import annotations

import contextlib
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


def stat_fields(stat: str) -> list[str]:
    """Fields 3.. of a /proc/PID/stat line (index 0 is field 3: the state)."""
    # comm (field 2) may hold spaces or parentheses; fields after the last ')' are fixed.
    return stat[stat.rindex(")") + 2 :].split()


def matches(rec: "ProcRecord", stat: str, cmdline: str) -> bool:
    """Is the process whose /proc stat and cmdline these are the one ``rec`` names?"""
    fields = stat_fields(stat)
    return int(fields[19]) == rec.starttime and rec.marker in cmdline and fields[0] != "Z"


def _stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat, or None if no such process."""
    try:
        return stat_fields(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


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


def is_ours(rec: ProcRecord) -> bool:
    try:
        stat = Path(f"/proc/{rec.pid}/stat").read_text()
    except OSError:
        return False
    return matches(rec, stat, _cmdline(rec.pid))


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


def stop(rec: ProcRecord, timeout: float = 5.0, sig: str = "TERM") -> str:
    """SIG``sig`` (TERM; USR1 asks an agent to drain first), then SIGKILL after
    ``timeout``. Returns what happened, for the user."""
    if not is_ours(rec):
        return "not running"
    os.kill(rec.pid, getattr(signal, f"SIG{sig}"))
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


def inner_pid(proc: subprocess.Popen) -> int:
    """The process that does the work: ``proc`` itself, or, when ``proc`` is an
    ``nsenter --pid`` (which forks the command into the target's PID namespace and
    forwards no signals), its one child. Signal this, then wait for ``proc``."""
    try:
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        return proc.pid
    is_nsenter = Path(f"/proc/{proc.pid}/comm").read_text().strip() == "nsenter" if kids else False
    return int(kids[0]) if is_nsenter else proc.pid


def kill_child(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGKILL a child we hold (through ``nsenter`` if it is one) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(inner_pid(proc), signal.SIGKILL)
        proc.wait(timeout=timeout)


def stop_child(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a child this process started and still holds (so its PID cannot have been
    reused): SIGTERM, SIGKILL after ``timeout``, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(inner_pid(proc), signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_child(proc, timeout)


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
