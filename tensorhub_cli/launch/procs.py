"""Processes started on this machine, identified by more than their PID.

Protocol: ``spawn`` starts a detached process (own session, stdin closed, output to a
log file) and returns a ``ProcRecord``. A record names a process by PID *and* kernel
start time *and* a marker in its command line, so ``is_ours`` is false once the PID has
been reused by anything else, and ``stop`` can never signal a stranger.

Process facts come from psutil, but for the start time: the kernel's own number, read
from ``/proc/PID/stat`` (field 22, clock ticks from boot to the process's start), not
psutil's wall-clock ``create_time()``: ticks never move when the system clock is
stepped (NTP, a resumed VM), so a record written by ``th up`` still matches in a later
``th down``; it is also the number an ssh node's shell reports (``launch/ssh.py``), and
the number ``state.json`` has always held.

Every wait takes its limit as an argument; the module constants are only the
documented defaults of those arguments.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import psutil

STOP_TIMEOUT_S = 5.0  # default grace between SIGTERM (or USR1) and SIGKILL
KILL_TIMEOUT_S = 2.0  # default wait for a SIGKILLed process to be gone
CHILD_TIMEOUT_S = 10.0  # default wait for a child we hold to exit after each signal


class ProcRecord(msgspec.Struct):
    role: str  # "hub" or "agent"
    node: str
    pid: int
    starttime: int  # clock ticks from boot to the process's start (kernel's starttime)
    marker: str  # a string that must appear in the process's command line
    log: str
    # A runner's endpoint name when it is not ``ROLE-NODE`` (the second runner of a
    # role on a node: ``ROLE-NODE-1``); "" for the hub, agents and older records.
    name: str = ""


def endpoint_name(rec: ProcRecord) -> str:
    """The name a recorded process goes by (at the hub, in logs): ``ROLE-NODE`` unless
    the record names it."""
    return rec.name or f"{rec.role}-{rec.node}"


def stat_fields(stat: str) -> list[str]:
    """Fields 3.. of a /proc/PID/stat line (index 0 is field 3: the state)."""
    # comm (field 2) may hold spaces or parentheses; fields after the last ')' are fixed.
    return stat[stat.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int:
    """The kernel's start time of process ``pid``, in clock ticks since boot.
    Raises ``psutil.NoSuchProcess`` when there is no such process."""
    # Read from /proc, not derived from psutil's create_time() less boot_time(): both
    # are wall-clock (btime moves when the clock is stepped); the likely cause of one
    # CI run finding a process it had just started "not ours".
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(stat_fields(f.read())[19])
    except (FileNotFoundError, ProcessLookupError):
        raise psutil.NoSuchProcess(pid) from None


def cpu_seconds(pid: int) -> float:
    """CPU time the process has used so far: where Linux keeps it, the scheduler's
    nanosecond count summed over the process's threads (``/proc/PID/task/*/schedstat``),
    else user + system time in clock ticks (10 ms: a hub phase that costs less reads 0)."""
    total, seen = 0, False
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                with open(f"{task.path}/schedstat") as f:
                    total += int(f.read().split()[0])
                seen = True
            except (OSError, ValueError, IndexError):
                continue  # (a thread that just ended)
    except OSError:
        pass
    if seen:
        return total / 1e9
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        raise ProcessLookupError(f"no process {pid}") from None
    return times.user + times.system


def _ours(rec: ProcRecord) -> psutil.Process | None:
    """The live process ``rec`` names, or None (gone, a zombie, or a reused PID)."""
    try:
        proc = psutil.Process(rec.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # it has exited; only its exit status waits to be reaped
        if start_ticks(rec.pid) != rec.starttime or rec.marker not in " ".join(proc.cmdline()):
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None  # NoSuchProcess covers ZombieProcess; AccessDenied: not one we started


def is_ours(rec: ProcRecord) -> bool:
    return _ours(rec) is not None


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
    try:
        start = start_ticks(proc.pid)
    except psutil.NoSuchProcess:
        raise RuntimeError(f"{role} on {node} exited at once; see {log}") from None
    # Popen keeps a handle to reap the child; `th up` exits soon and init reaps it then.
    return ProcRecord(role=role, node=node, pid=proc.pid, starttime=start, marker=marker, log=str(log))


def stop(rec: ProcRecord, timeout: float = STOP_TIMEOUT_S, sig: str = "TERM",
         kill_timeout: float = KILL_TIMEOUT_S) -> str:
    """SIG``sig`` (TERM; USR1 asks an agent to drain first), then SIGKILL after
    ``timeout`` seconds, then wait up to ``kill_timeout`` for it to be gone. Returns
    what happened, for the user."""
    proc = _ours(rec)
    if proc is None:
        return "not running"
    try:
        # psutil re-checks the PID's identity before it signals: no stranger in between.
        proc.send_signal(getattr(signal, f"SIG{sig}"))
    except psutil.NoSuchProcess:
        return "stopped"  # it exited between the look and the signal
    except psutil.AccessDenied:
        return _refused(rec, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(rec.pid)
        if not is_ours(rec):
            return "stopped"
        time.sleep(0.05)
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        return "stopped"
    except psutil.AccessDenied:
        return _refused(rec, "KILL")
    deadline = time.monotonic() + kill_timeout
    while True:
        _reap(rec.pid)
        if not is_ours(rec):
            return "killed"
        if time.monotonic() >= deadline:
            return "would not die"
        time.sleep(0.02)


def _refused(rec: ProcRecord, sig: str) -> str:
    """The outcome of a signal the kernel refused: the PID changed hands between our
    look and the signal (the process exited, a process we may not signal took it)."""
    if not is_ours(rec):
        return "stopped"
    return f"unknown: SIG{sig} to {rec.role} on {rec.node} (pid {rec.pid}) was refused (permission denied)"


def inner_pid(proc: subprocess.Popen) -> int:
    """The process that does the work: ``proc`` itself, or, when ``proc`` is an
    ``nsenter --pid`` (which forks the command into the target's PID namespace and
    forwards no signals), its one child. Signal this, then wait for ``proc``."""
    try:
        outer = psutil.Process(proc.pid)
        kids = outer.children() if outer.name() == "nsenter" else []
    except psutil.Error:
        return proc.pid
    return kids[0].pid if kids else proc.pid


def kill_child(proc: subprocess.Popen, timeout: float = CHILD_TIMEOUT_S) -> None:
    """SIGKILL a child we hold (through ``nsenter`` if it is one) and reap it, waiting
    up to ``timeout`` seconds (``subprocess.TimeoutExpired`` past that)."""
    if proc.poll() is None:
        # The inner process may be gone, its PID even reused, by the time we signal.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(inner_pid(proc), signal.SIGKILL)
        proc.wait(timeout=timeout)


def stop_child(proc: subprocess.Popen, timeout: float = CHILD_TIMEOUT_S) -> None:
    """Stop a child this process started and still holds (so its PID cannot have been
    reused): SIGTERM, SIGKILL after ``timeout`` seconds, and reap it (waiting up to
    ``timeout`` again)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
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
