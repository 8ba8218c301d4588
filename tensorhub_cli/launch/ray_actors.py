"""The actors ``launcher: ray`` runs: one ``ProcessActor`` per process, one ``Follower``.

Protocol of ``ProcessActor`` (detached, named ``<cluster>.<process name>``, pinned to
its node by node-affinity, 0 CPUs): its constructor writes the cluster token (0600) into
the node directory (``~/.tensorhub/<cluster>/nodes/<node>/`` on that node) when given
one, replaces ``{NODE_DIR}`` and ``{PYTHON}`` (the worker's interpreter) in the command
line, and starts the process there in a session of its own, its output appended to the
log file. The process is a child of a thread that lives until it exits, with
``PR_SET_PDEATHSIG`` = SIGKILL: when the actor dies (``ray.kill``, its node lost) the
process dies with it, so no process outlives its actor. The methods report and signal
that one process (``info``, ``alive``, ``signal``) and read its log (``tail``, ``read``
from an offset, for ``th logs --follow``); the actor stays after the process exits, so
its log and exit stay readable until ``th down`` (or a restart) kills the actor.

Protocol of ``Follower`` (detached, named ``<cluster>.follow``, on the node that ran
``th up``, whose ``$TH_HOME`` it shares): every ``ray.follow_s`` seconds it runs
``ray_follow.step`` (a node that joined gets an agent, one that left is failed over),
and answers ``lookup(ray_node_id | node)``: the ``connect`` options of an endpoint on
that node (hub, token, place): how a process inside any Ray worker joins the cluster
with no environment variables (``launch.ray_lookup``).

This module imports without ray: the launcher wraps the classes with ``ray.remote``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..tokens import write_token_file

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not glibc: the actor's own shutdown still stops it (``th down`` signals first)


class ProcessActor:
    def __init__(self, argv: list[str], log: str, node_dir: str, token: str | None = None,
                 env: dict[str, str] | None = None):
        self.node_dir = os.path.expanduser(node_dir)
        os.makedirs(self.node_dir, exist_ok=True)
        if token is not None:
            write_token_file(os.path.join(self.node_dir, "token"), token)

        def fill(text: str) -> str:
            return text.replace("{NODE_DIR}", self.node_dir).replace("{PYTHON}", sys.executable)

        self.argv = [fill(a) for a in argv]
        self.log = fill(log)
        child_env = {**os.environ, **(env or {})}
        if child_env.get("CUDA_VISIBLE_DEVICES") == "":  # Ray hides GPUs from a 0-GPU actor, not from its process
            child_env.pop("CUDA_VISIBLE_DEVICES")
        started = threading.Event()
        self.error: str | None = None
        self.proc: subprocess.Popen | None = None

        def own() -> None:
            try:
                with open(self.log, "ab") as out:
                    self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                                 stderr=subprocess.STDOUT, env=child_env, close_fds=True,
                                                 start_new_session=True, preexec_fn=_die_with_parent)
            except OSError as exc:
                self.error = f"cannot start {self.argv[:3]}: {exc}"
            finally:
                started.set()
            if self.proc is not None:
                self.proc.wait()

        threading.Thread(target=own, name="th-process", daemon=True).start()
        started.wait()
        if self.error:
            raise RuntimeError(self.error)
        from .procs import start_ticks

        try:
            self.starttime = start_ticks(self.proc.pid)
        except Exception:  # exited before its start time could be read
            self.starttime = 0

    def info(self) -> dict:
        return {"pid": self.proc.pid, "starttime": self.starttime, "log": self.log, "node_dir": self.node_dir,
                "exit": self.proc.poll()}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, name: str) -> bool:
        """Send SIG``name``; False when the process had already exited."""
        if self.proc.poll() is not None:
            return False
        try:
            self.proc.send_signal(getattr(signal, f"SIG{name}"))
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float) -> bool:
        """True once the process has exited, waiting at most ``timeout`` seconds."""
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def tail(self, lines: int = 8) -> str:
        try:
            text = Path(self.log).read_text(errors="replace").splitlines()
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text[-lines:]) or "(empty log)"

    def read(self, offset: int, limit: int = 1 << 20) -> tuple[str, int]:
        """The log from byte ``offset`` (at most ``limit`` bytes) and the offset after it."""
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                data = f.read(limit)
        except OSError:
            return "", offset
        return data.decode(errors="replace"), offset + len(data)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(os.path.expanduser(path), ignore_errors=True)


class Follower:
    def __init__(self, cluster: str, th_home: str, given_yaml: str):
        os.environ["TH_HOME"] = th_home  # this worker is ours alone: its state is the CLI's
        self.cluster = cluster
        self.given_yaml = given_yaml
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name="th-follow", daemon=True).start()

    def _log(self, line: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {line}"
        print(stamped, flush=True)
        with self._lock:
            self.lines.append(stamped)
            del self.lines[:-1000]

    def _loop(self) -> None:
        from . import ray_follow

        given = ray_follow.given_spec(self.given_yaml)
        period = given.ray_or_default().follow_s
        while not self._stop.is_set():
            try:
                ray_follow.step(self.cluster, given, self._log)
            except Exception as exc:  # a bad round is logged; the next one tries again
                self._log(f"follow: {type(exc).__name__}: {exc}")
            self._stop.wait(period)

    def ping(self) -> bool:
        return True

    def events(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def lookup(self, ray_node_id: str | None = None, node: str | None = None) -> dict:
        """``connect`` options for an endpoint on the node (by Ray node id or name);
        ``{"error": why}`` when there is none."""
        from .lookup import endpoint_options
        from .ray_nodes import node_of
        from .state import cluster_dir
        from ..spec import load

        try:
            if node is None:
                spec = load(cluster_dir(self.cluster) / "spec.yaml")
                placed = node_of(spec, ray_node_id)
                if placed is None:
                    return {"error": f"Ray node {ray_node_id} is not (yet) a node of cluster {self.cluster!r}: "
                                     f"it gets one within {spec.ray_or_default().follow_s:g}s of joining"}
                node = placed.name
            options = endpoint_options(self.cluster, node)
        except Exception as exc:  # (a lookup error, an unreadable spec or state): the caller's to show
            return {"error": f"cluster {self.cluster!r}: {exc}"}
        return {**options, "node": node}

    def stop(self) -> None:
        self._stop.set()
