"""SSH launcher: the hub and agents run on the spec's nodes, started over paramiko.

Connection: key auth (the spec's ``key_file``, ssh-agent, and ``~/.ssh/config``'s
``HostName``/``User``/``IdentityFile`` where the spec says nothing). Host keys are
checked against ``known_hosts`` by default; an unknown or changed key is an error
that says how to accept it on purpose. Every remote command runs with a timeout.

On each node everything lives in ``~/.tensorhub/<cluster>/nodes/<node>/`` (relative
to the remote login's home): the token (0600), ``<role>.log`` and ``<role>.pid``
(a second runner of a role on the node: ``<role>-<node>-<i>.log``/``.pid``). A
start runs the node's bootstrap prefix and detaches the process with ``setsid`` in a
subshell whose stdio is redirected, so the SSH channel closes at once (a backgrounded
list that keeps the channel's stdout would hold it open for the process's life). A
``ProcRecord`` names the remote process by PID, start time and a command-line
marker, as for local processes, so ``stop`` never signals a stranger. The remote
side reads that identity with ``cat /proc/PID/stat`` in the same shell line that
starts or probes the process, not with psutil: a probe runs every 0.1 s while a stop
waits, needs no Python start-up or bootstrap prefix, and works with whatever is
installed on the node; ``stat_fields`` reads the reply here. The start time it gives
is the kernel's clock ticks since boot, the number local records hold too.

Timeouts: connecting takes the spec's ``ssh.connect_timeout_s`` (optionally capped by
the caller); every remote command takes ``exec_timeout`` (per launcher, overridable per
call); the preflight import check, which starts a Python on the node, ``check_timeout``.
"""

from __future__ import annotations

import shlex
import socket
import threading
import time
from pathlib import Path

import paramiko

from ..spec import ClusterSpec, PlacedNode
from ..tokens import token_shell
from .procs import STOP_TIMEOUT_S, ProcRecord, stat_fields

EXEC_TIMEOUT_S = 20.0  # default limit of one remote command (and of silence in a stream)
CHECK_TIMEOUT_S = 60.0  # default limit of the preflight check: a cold node's first Python import
UNRECORDED_KILL_TIMEOUT_S = 10.0  # default limit of the clean-up after a start that timed out


def matches(rec: ProcRecord, stat: str, cmdline: str) -> bool:
    """Is the remote process whose /proc stat and cmdline these are the one ``rec`` names?"""
    fields = stat_fields(stat)
    return int(fields[19]) == rec.starttime and rec.marker in cmdline and fields[0] != "Z"


class SshError(Exception):
    """A per-node failure, already worded for the user (names the node)."""


def _accept_hint(address: str, port: int, known_hosts: str) -> str:
    target = address if port == 22 else f"[{address}]:{port}"
    return (f"to accept it on purpose, check its fingerprint and run: "
            f"ssh-keyscan -p {port} {address} >> {known_hosts}  (or remove a stale entry: "
            f"ssh-keygen -R '{target}' -f {known_hosts})")


class Session:
    """One authenticated connection to one node; ``run`` executes a command there."""

    def __init__(self, node: PlacedNode, spec: ClusterSpec, connect_timeout: float | None = None,
                 exec_timeout: float = EXEC_TIMEOUT_S):
        """``connect_timeout`` caps the spec's ``connect_timeout_s``; ``exec_timeout`` is
        the default limit of each ``run``."""
        self.node = node
        self.exec_timeout = exec_timeout
        cfg = spec.ssh_for(node.spec)
        if connect_timeout is not None:
            cfg = cfg.model_copy(update={"connect_timeout_s": min(connect_timeout, cfg.connect_timeout_s or 10.0)})
        self.known_hosts = str(Path(cfg.known_hosts or "~/.ssh/known_hosts").expanduser())
        ssh_config = _ssh_config(node.spec.address)
        self.address = ssh_config.get("hostname", node.spec.address)
        self.port = int(cfg.port or ssh_config.get("port", 22))
        self.user = cfg.user or ssh_config.get("user") or _local_user()
        key_files = [str(Path(cfg.key_file).expanduser())] if cfg.key_file else [
            str(Path(k).expanduser()) for k in ssh_config.get("identityfile", [])]
        self.client = paramiko.SSHClient()
        try:
            self.client.load_host_keys(self.known_hosts)
        except FileNotFoundError:
            if cfg.strict_host_keys:
                raise SshError(f"{node.name}: known_hosts file {self.known_hosts} does not exist; "
                               + _accept_hint(self.address, self.port, self.known_hosts)) from None
        self.client.set_missing_host_key_policy(
            paramiko.RejectPolicy() if cfg.strict_host_keys else paramiko.WarningPolicy())
        where = f"{node.name} ({self.user}@{self.address}:{self.port})"
        try:
            self.client.connect(self.address, port=self.port, username=self.user, key_filename=key_files or None,
                                timeout=cfg.connect_timeout_s, banner_timeout=cfg.connect_timeout_s,
                                auth_timeout=cfg.connect_timeout_s, allow_agent=True, look_for_keys=not key_files)
        except paramiko.BadHostKeyException as exc:
            raise SshError(f"{where}: host key mismatch: the server offers {exc.key.get_name()} "
                           f"{exc.key.get_base64()[:24]}…, {self.known_hosts} has a different key (a reinstalled "
                           f"node, or someone in between); "
                           + _accept_hint(self.address, self.port, self.known_hosts)) from None
        except paramiko.AuthenticationException as exc:
            raise SshError(f"{where}: authentication failed ({exc}); tried key "
                           f"{', '.join(key_files) or '(default keys)'} and ssh-agent") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise SshError(f"{where}: unknown host key (not in {self.known_hosts}); "
                               + _accept_hint(self.address, self.port, self.known_hosts)) from None
            raise SshError(f"{where}: ssh failed: {exc}") from None
        except (OSError, socket.timeout) as exc:
            raise SshError(f"{where}: unreachable: {exc}") from None

    def run(self, command: str, timeout: float | None = None, stdin: str | None = None) -> tuple[int, str, str]:
        """Run ``command`` and wait for it, at most ``timeout`` seconds (default: the
        session's ``exec_timeout``): (exit status, stdout, stderr)."""
        timeout = self.exec_timeout if timeout is None else timeout
        try:
            chan_in, chan_out, chan_err = self.client.exec_command(command, timeout=timeout)
            if stdin is not None:
                chan_in.write(stdin)
            chan_in.channel.shutdown_write()
            out = chan_out.read().decode(errors="replace")
            err = chan_err.read().decode(errors="replace")
            return chan_out.channel.recv_exit_status(), out, err
        except (socket.timeout, TimeoutError):
            raise SshError(f"{self.node.name}: `{command[:80]}` did not finish within {timeout:.0f}s") from None
        except (paramiko.SSHException, OSError) as exc:
            raise SshError(f"{self.node.name}: ssh connection lost: {exc}") from None

    def stream(self, command: str, write, idle_timeout: float = EXEC_TIMEOUT_S, forever: bool = False) -> int:
        """Run ``command`` and pass its output to ``write`` as it comes. Without
        ``forever``, silence longer than ``idle_timeout`` is an error."""
        chan = self.client.get_transport().open_session(timeout=idle_timeout)
        chan.settimeout(idle_timeout)
        chan.set_combine_stderr(True)
        chan.exec_command(command)
        try:
            while True:
                try:
                    data = chan.recv(65536)
                except socket.timeout:
                    if forever:
                        continue
                    raise SshError(f"{self.node.name}: `{command[:80]}` went silent for {idle_timeout:.0f}s") from None
                if not data:
                    return chan.recv_exit_status()
                write(data.decode(errors="replace"))
        finally:
            chan.close()

    @property
    def home(self) -> str:
        if not hasattr(self, "_home"):
            rc, out, err = self.run("cd && pwd")
            if rc != 0 or not out.strip().startswith("/"):
                raise SshError(f"{self.node.name}: cannot find the login's home directory: {err.strip()}")
            self._home = out.strip()
        return self._home

    def close(self) -> None:
        self.client.close()


def _local_user() -> str:
    import getpass

    return getpass.getuser()


def _ssh_config(address: str) -> dict:
    path = Path("~/.ssh/config").expanduser()
    if not path.is_file():
        return {}
    return paramiko.SSHConfig.from_path(str(path)).lookup(address)




def start_command(directory: str, role: str, argv: list[str], prefix: str | None) -> str:
    """The remote shell line that detaches ``argv`` and prints its PID and start time;
    ``role`` names its ``.log`` and ``.pid`` files (a runner's own name when a node
    runs more than one of its role).

    ``exec setsid`` inside a background subshell keeps the PID ``$!`` names: that
    subshell is not a process-group leader, so setsid needs no fork."""
    d = shlex.quote(directory)
    cmd = " ".join(shlex.quote(a) for a in argv)
    body = f"{prefix} exec setsid {cmd}" if prefix else f"exec setsid {cmd}"
    # `;` and `||`, not `&&`, before the `&`: `a && (b) &` would background the whole
    # list, and that list's subshell would hold the channel's stdout.
    # `>>`: a restarted process (`th up` on a running cluster) keeps its predecessor's log.
    return (f"mkdir -p {d} || exit 1; cd {d} || exit 1; ( {body} ) < /dev/null >> {role}.log 2>&1 & "
            f"pid=$!; echo $pid > {role}.pid; echo $pid; cat /proc/$pid/stat")


def probe_command(pid: int) -> str:
    """Prints /proc/PID/stat (its own line, newline-terminated), then the cmdline."""
    return f"cat /proc/{pid}/stat 2>/dev/null && tr '\\0' ' ' < /proc/{pid}/cmdline 2>/dev/null"


class SshLauncher:
    def __init__(self, spec: ClusterSpec, state_dir: Path, connect_timeout: float | None = None,
                 exec_timeout: float = EXEC_TIMEOUT_S, check_timeout: float = CHECK_TIMEOUT_S):
        """``connect_timeout`` caps the spec's, e.g. for a quick ``th status``;
        ``exec_timeout`` limits each remote command; ``check_timeout`` the preflight."""
        self.spec = spec
        self.state_dir = state_dir
        self.connect_timeout = connect_timeout
        self.exec_timeout = exec_timeout
        self.check_timeout = check_timeout
        self.parallel = 16  # bounded: many nodes must not open hundreds of connections at once
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def session(self, node_name: str) -> Session:
        with self._lock:
            if node_name not in self._sessions:
                self._sessions[node_name] = Session(self.spec.node(node_name), self.spec, self.connect_timeout,
                                                    self.exec_timeout)
            return self._sessions[node_name]

    def node_dir(self, node_name: str) -> str:
        return f"{self.session(node_name).home}/.tensorhub/{self.spec.name}/nodes/{node_name}"

    def _python(self, node: PlacedNode) -> tuple[str, str | None]:
        boot = node.spec.bootstrap
        return (boot.python if boot and boot.python else "python3"), (boot.prefix if boot else None)

    def check_node(self, node: PlacedNode) -> str | None:
        """Can we log in, and does the node's python import us? None if so, else why."""
        try:
            python, prefix = self._python(node)
            line = f"{prefix + ' ' if prefix else ''}{shlex.quote(python)} -c 'import tensorhub_cli'"
            rc, out, err = self.session(node.name).run(line, timeout=self.check_timeout)
        except SshError as exc:
            return str(exc)
        if rc != 0:
            return f"{node.name}: `{line}` failed ({rc}): {(err or out).strip()[-400:]}"
        return None

    def preflight(self) -> list[str]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(self.parallel, len(self.spec.nodes()))) as pool:
            return [p for p in pool.map(self.check_node, self.spec.nodes()) if p]

    def token_path(self, node: PlacedNode, token: str) -> str:
        """Put the cluster token on the node (mode 0600); returns its remote path."""
        d = self.node_dir(node.name)
        rc, _, err = self.session(node.name).run(token_shell(d), stdin=token)
        if rc != 0:
            raise SshError(f"{node.name}: could not write the token: {err.strip()}")
        return f"{d}/token"

    def start(self, node: PlacedNode, role: str, module: str, args: list[str], name: str | None = None) -> ProcRecord:
        """``name``: a runner's endpoint name; one other than ``ROLE-NODE`` (a second
        runner of the role on the node) gets its own ``NAME.log`` and ``NAME.pid``."""
        python, prefix = self._python(node)
        d = self.node_dir(node.name)
        stem = role if name in (None, f"{role}-{node.name}") else name
        try:
            rc, out, err = self.session(node.name).run(start_command(d, stem, [python, "-m", module, *args], prefix))
        except SshError:
            self._kill_unrecorded(node.name, f"{d}/{stem}.pid", module)
            raise
        lines = out.split("\n")
        if rc != 0 or len(lines) < 2 or not lines[0].strip().isdigit():
            raise SshError(f"{node.name}: could not start {role} ({rc}): {(err or out).strip()[-400:]}")
        pid, stat = int(lines[0]), lines[1]
        return ProcRecord(role=role, node=node.name, pid=pid, starttime=int(stat_fields(stat)[19]), marker=module,
                          log=f"{d}/{stem}.log")

    def _kill_unrecorded(self, node_name: str, pid_file: str, marker: str,
                         timeout: float = UNRECORDED_KILL_TIMEOUT_S) -> None:
        """A start that timed out may still have started the process: stop it by the
        pid file it wrote, if that PID runs our module, so a rollback leaves nothing."""
        script = (f"pid=$(cat {shlex.quote(pid_file)} 2>/dev/null) && tr '\\0' ' ' < /proc/$pid/cmdline | "
                  f"grep -qF -- {shlex.quote(marker)} && kill -KILL $pid")
        try:
            self.session(node_name).run(script, timeout=timeout)
        except SshError:
            pass

    def alive(self, rec: ProcRecord) -> bool:
        rc, out, _ = self.session(rec.node).run(probe_command(rec.pid))
        stat, _, cmdline = out.partition("\n")
        return rc == 0 and bool(stat) and matches(rec, stat, cmdline)

    def stop(self, rec: ProcRecord, timeout: float = STOP_TIMEOUT_S, sig: str = "TERM") -> str:
        """SIG``sig``, then SIGKILL after ``timeout`` seconds; each remote command is
        limited by ``exec_timeout``."""
        if sig not in ("TERM", "USR1"):
            raise ValueError(f"signal {sig!r}: only TERM or USR1")
        try:
            if not self.alive(rec):
                return "not running"
            self.session(rec.node).run(f"kill -{sig} {rec.pid}")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not self.alive(rec):
                    return "stopped"
                time.sleep(0.1)
            self.session(rec.node).run(f"kill -KILL {rec.pid}")
            return "killed"
        except SshError as exc:
            return f"unknown: {exc}"

    def log_tail(self, rec: ProcRecord, lines: int = 8) -> str:
        try:
            _, out, _ = self.session(rec.node).run(f"tail -n {lines} {shlex.quote(rec.log)} 2>&1")
        except SshError as exc:
            return f"(log unreadable: {exc})"
        return out.rstrip() or "(empty log)"

    def remove_tree(self, node: str, path: str) -> None:
        """Delete ``path`` on ``node`` (what a dead process left behind), if it exists."""
        rc, _, err = self.session(node).run(f"rm -rf -- {shlex.quote(path)}")
        if rc != 0:
            raise SshError(f"{node}: cannot remove {path}: {err.strip()}")

    def logs(self, rec: ProcRecord, lines: int, follow: bool, write) -> None:
        cmd = f"tail -n {lines} {'-F ' if follow else ''}{shlex.quote(rec.log)}"
        self.session(rec.node).stream(cmd, write, idle_timeout=self.exec_timeout, forever=follow)

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        self._sessions.clear()
