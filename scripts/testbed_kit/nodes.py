"""Each testbed node as a machine: its own network, PID and UTS namespace, and an
OpenSSH server as that PID namespace's first process.

Why PID and UTS too: UCX takes processes that share a hostname and can see each
other's PIDs for one host and moves bytes by shared memory (CMA), which would bypass
the shaped links. Why sshd as PID 1: when it dies the kernel kills everything else in
the node, so stopping one recorded PID leaves nothing of that node behind.

Keys live under the testbed directory: one client key (key-only root login), one host
key per node, and a known_hosts file with every node's host key.

A node's sshd is recorded by host PID and kernel start time (clock ticks since boot,
read through psutil), so a reused PID is never signalled.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

try:
    import psutil
except ImportError:  # the system python3 scripts/testbed falls back to may lack it
    raise SystemExit(f"scripts/testbed needs psutil, which {sys.executable} lacks: run it with TH_PYTHON set to "
                     "the python `th` runs with (`th bench` does so itself), or build .venv (`make venv`)") from None

from .fabric import Node
from .net import NetError, sh

SSHD = "/usr/sbin/sshd"


def ensure_openssh() -> None:
    """Install Debian's openssh-server when sshd is missing (the testbed runs as root)."""
    if Path(SSHD).exists() and shutil.which("ssh-keygen"):
        return
    print("testbed: installing openssh-server (sshd is missing) …", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "openssh-server"]):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise NetError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[-500:]}")
    if not Path(SSHD).exists():
        raise NetError(f"openssh-server installed but {SSHD} is missing")


def keygen(path: Path, comment: str) -> str:
    """An ed25519 key pair at ``path`` (made once); returns the public key line."""
    if not path.exists():
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return Path(f"{path}.pub").read_text().strip()


def sshd_config(node: Node, node_dir: Path, authorized_keys: Path) -> Path:
    conf = node_dir / "sshd_config"
    conf.write_text("\n".join([
        f"ListenAddress {node.address}",
        "Port 22",
        f"HostKey {node_dir / 'host_ed25519'}",
        f"PidFile {node_dir / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # the keys sit under a temp tree, not a home directory
        "PrintMotd no",
        "MaxStartups 100:30:200",  # `th up` opens one session per node at once, plus checks
        "MaxSessions 50",
        "ClientAliveInterval 5",
        "Subsystem sftp internal-sftp",
        "",
    ]))
    return conf


def _children(pid: int) -> list[int]:
    try:
        return [kid.pid for kid in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def starttime(pid: int) -> int | None:
    """Kernel start time of ``pid`` in clock ticks since boot, or None if it is gone."""
    # Field 22 of /proc/PID/stat itself: psutil's create_time() less boot_time() is
    # wall-clock on both sides and moves when the clock is stepped between the reads.
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def start_sshd(node: Node, node_dir: Path, authorized_keys: Path, timeout: float = 15.0) -> dict:
    """Start the node's sshd as PID 1 of a new PID+UTS namespace inside the node's
    network namespace; returns its record (host PID + start time) once it listens."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    conf = sshd_config(node, node_dir, authorized_keys)
    log = open(node_dir / "sshd.log", "ab")
    boot = f"hostname {node.name} && exec {SSHD} -D -e -f {conf}"
    proc = subprocess.Popen(["ip", "netns", "exec", node.ns, "unshare", "--pid", "--fork", "--mount-proc", "--uts",
                             "--", "/bin/sh", "-c", boot], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout
    sshd = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NetError(f"{node.name}: sshd exited at start ({proc.returncode}); "
                           f"{(node_dir / 'sshd.log').read_text()[-800:]}")
        kids = _children(proc.pid)
        if kids and "sshd" in _cmdline(kids[0]):
            sshd = kids[0]
            try:
                with socket.create_connection((node.address, 22), timeout=0.5):
                    return {"node": node.name, "pid": sshd, "starttime": starttime(sshd), "unshare_pid": proc.pid}
            except OSError:
                pass
        time.sleep(0.05)
    raise NetError(f"{node.name}: sshd did not listen on {node.address}:22 within {timeout:.0f}s "
                   f"(pid {sshd}); {(node_dir / 'sshd.log').read_text()[-800:]}")


def stop_sshd(rec: dict, timeout: float = 5.0) -> str:
    """Stop a node by its sshd's recorded PID (only if that PID is still the same
    process). The kernel then kills every process left in the node's PID namespace."""
    pid = rec["pid"]
    if starttime(pid) != rec["starttime"]:
        return "not running"
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if starttime(pid) != rec["starttime"] or _zombie(pid):
            return "stopped"
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    return "killed"


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def known_hosts_line(node: Node, node_dir: Path) -> str:
    key_type, key = (node_dir / "host_ed25519.pub").read_text().split()[:2]
    return f"{node.address} {key_type} {key}"
