"""The remote shell lines the ssh launcher sends, run here in a local bash: the start
line must return at once (not hold its stdout for the process's life), print the PID
of the process itself, and the probe must recognise exactly that process."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from tensorhub_cli.launch.procs import ProcRecord, start_ticks
from tensorhub_cli.launch.ssh import matches, probe_command, start_command, stat_fields


def test_start_detaches_returns_at_once_and_names_the_process(tmp_path):
    line = start_command(str(tmp_path / "node"), "agent", ["sleep", "37.5"], prefix="true &&")
    t0 = time.monotonic()
    # stdout is a pipe, as an SSH channel is: run() returns only once every writer closed it
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=10)
    took = time.monotonic() - t0
    pid = int(done.stdout.split("\n")[0])
    try:
        assert done.returncode == 0 and took < 3, (took, done.stderr)
        assert (tmp_path / "node" / "agent.pid").read_text().strip() == str(pid)
        rec = ProcRecord(role="agent", node="n", pid=pid, starttime=int(stat_fields(done.stdout.split("\n")[1])[19]),
                         marker="37.5", log=str(tmp_path / "node" / "agent.log"))
        probe = subprocess.run(["bash", "-c", probe_command(pid)], capture_output=True, text=True, timeout=10)
        stat, _, cmdline = probe.stdout.partition("\n")
        assert matches(rec, stat, cmdline) and cmdline.startswith("sleep 37.5")
        assert os.getsid(pid) == pid  # its own session: it outlives the SSH session
        other = ProcRecord(role="agent", node="n", pid=pid, starttime=rec.starttime + 1, marker="37.5", log="")
        assert not matches(other, stat, cmdline)  # a reused PID is not ours
        assert start_ticks(pid) == rec.starttime  # a node's shell and psutil give the same number
    finally:
        os.kill(pid, signal.SIGKILL)
