"""A runner's supervisor: starts it, restarts it by the role's policy, tells the hub at once when it died.

``th scale`` (and ``th up`` for a role's ``count``) starts each runner as
``python -m tensorhub_cli.agent.supervise --name NAME --policy P ... -- MODULE ARGS...``
on its node; the launcher records the supervisor's PID, so ``th down`` stops it like
any other process.

Protocol:

- The runner is ``sys.executable -m MODULE ARGS...``, in the supervisor's session,
  with ``TH_INCARNATION`` set to a fresh id per start (its endpoint registers under
  it) and a parent-death signal of SIGKILL, so a supervisor killed with -9 never
  leaves a runner behind that nobody records.
- SIGTERM, SIGINT and SIGUSR1 go on to the runner and mean "leave": no restart; the
  supervisor exits with the runner's status once it has exited (the launcher's grace
  and SIGKILL bound that).
- When the runner exits on its own, the supervisor first deregisters that incarnation
  at the hub (``--hub``/``--token-file``; best effort, ``--call-timeout-s``): the
  process is known dead, so its pins and reads go now rather than at expiry, and its
  successor is not refused as a second live process under the name. Then
  ``Restarts.after`` decides: restart after a backoff, or stop with an outcome:
  ``finished`` (exit 0 under ``on-failure``), ``exited`` (``never``) or ``gave_up``
  (``max_restarts`` within ``window_s`` used up).
- Its last line in the log is ``[th-supervise] outcome {"outcome": ..., "exit": ...,
  "restarts": ..., "pid": ...}`` (``OUTCOME_TAG``): ``th up`` reads it from a dead
  runner's log to tell a finished runner (forgotten) from a crashed one (restarted).
  Every line names the supervisor's pid, since one log file serves every restart of
  a name.

Why one supervisor per runner and not a thread of the node's agent: an agent that
dies (``kill_agent``) must not take the node's GPU runners with it, and a runner's
crash must not disturb the agent's copies.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

OUTCOME_TAG = "[th-supervise] outcome "
BACKOFF_CAP_S = 60.0
PR_SET_PDEATHSIG = 1


@dataclass
class Restarts:
    """The restart policy's arithmetic, apart from processes (``spec.RestartSpec``)."""

    policy: str = "on-failure"
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    times: deque = field(default_factory=deque)

    def after(self, code: int, now: float) -> tuple[str, float]:
        """The runner exited with ``code`` at ``now``: ``("restart", delay_s)``, or
        ``(outcome, 0)`` with outcome ``finished``, ``exited`` or ``gave_up``."""
        if self.policy == "never":
            return "exited", 0.0
        if self.policy == "on-failure" and code == 0:
            return "finished", 0.0
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return "gave_up", 0.0
        delay = min(BACKOFF_CAP_S, self.backoff_s * 2 ** len(self.times))
        self.times.append(now)
        return "restart", delay


def outcome_of(log_tail: str, pid: int) -> Optional[dict]:
    """The final record of supervisor ``pid`` in a log's tail, or None if it wrote none
    (it was killed, or never supervised). A log outlives restarts, so an older
    supervisor's record there is not this one's."""
    for line in reversed(log_tail.splitlines()):
        if line.startswith(OUTCOME_TAG):
            try:
                record = json.loads(line[len(OUTCOME_TAG):])
            except ValueError:
                continue
            if record.get("pid") == pid:
                return record
    return None


def exited_line(name: str, pid: int) -> str:
    """What supervisor ``pid`` of runner ``name`` logs when its runner exits on its own
    (``scale`` watches for it: a runner that dies before it registered is a bad start)."""
    return f"[th-supervise] {name}[{pid}]: runner exited"


def restart_args(restart) -> list[str]:
    """The flags for a role's ``spec.RestartSpec``."""
    return ["--policy", restart.policy, "--max-restarts", str(restart.max_restarts),
            "--window-s", str(restart.window_s), "--backoff-s", str(restart.backoff_s)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # -N: killed by signal N, as a shell reports it


class Supervisor:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.restarts = Restarts(args.policy, args.max_restarts, args.window_s, args.backoff_s)
        self.leaving = threading.Event()
        self.child: Optional[subprocess.Popen] = None
        self.incarnation = ""

    def say(self, text: str) -> None:
        # our pid on every line: the log is appended to across restarts of the name
        print(f"[th-supervise] {self.args.name}[{os.getpid()}]: {text}", flush=True)

    def forward(self, sig: int, _frame=None) -> None:
        self.leaving.set()
        child = self.child
        if child is not None and child.poll() is None:
            child.send_signal(sig)

    def start(self) -> None:
        self.incarnation = uuid.uuid4().hex
        env = {**os.environ, "TH_INCARNATION": self.incarnation}
        self.child = subprocess.Popen([sys.executable, "-m", self.args.module, *self.args.runner_args],
                                      env=env, preexec_fn=_die_with_parent)

    def tell_hub(self) -> None:
        if not self.args.hub:
            return
        from ..hub import protocol as p
        from ..errors import BadArgument
        from ..hub.client import HubClient, HubError, HubUnreachable
        from ..tokens import read_token_file

        client = None
        try:
            client = HubClient(self.args.hub, read_token_file(self.args.token_file))
            client.call(p.Deregister(name=self.args.name, incarnation=self.incarnation),
                        timeout=self.args.call_timeout_s)
            self.say("deregistered the dead runner at the hub")
        except (HubError, HubUnreachable, OSError, BadArgument) as exc:  # it expires at the hub instead
            self.say(f"could not deregister it at the hub ({exc}); it will expire there")
        finally:
            if client is not None:
                client.close()

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self.forward)
        code, outcome = 0, "left"
        while True:
            self.start()
            self.say(f"started {self.args.module} (pid {self.child.pid})")
            code = _status(self.child.wait())
            if self.leaving.is_set():
                outcome = "left"
                break
            self.say(f"runner exited with status {code}")
            self.tell_hub()
            outcome, delay = self.restarts.after(code, time.monotonic())
            if outcome != "restart":
                break
            self.say(f"restarting in {delay:.1f}s ({len(self.restarts.times)} of {self.args.max_restarts} "
                     f"restarts in {self.args.window_s:.0f}s)")
            if self.leaving.wait(delay):
                outcome = "left"
                break
        record = {"outcome": outcome, "exit": code, "restarts": len(self.restarts.times), "pid": os.getpid()}
        print(OUTCOME_TAG + json.dumps(record), flush=True)
        return code


def parse(argv: list[str]) -> argparse.Namespace:
    """``OPTIONS -- MODULE ARGS...``: split at the first ``--`` by hand, so no runner
    argument is ever taken for one of ours."""
    ap = argparse.ArgumentParser(prog="python -m tensorhub_cli.agent.supervise",
                                 usage="%(prog)s --name NAME [options] -- MODULE [ARGS...]",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--name", required=True, help="the runner's endpoint name")
    ap.add_argument("--policy", choices=["on-failure", "always", "never"], default="on-failure")
    ap.add_argument("--max-restarts", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=600.0)
    ap.add_argument("--backoff-s", type=float, default=1.0)
    ap.add_argument("--hub", help="tcp://HOST:PORT, to deregister a dead runner at once")
    ap.add_argument("--token-file")
    ap.add_argument("--call-timeout-s", type=float, default=3.0)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("give the runner after --: -- MODULE [ARGS...]")
    cut = argv.index("--")
    args = ap.parse_args(argv[:cut])
    args.module, args.runner_args = argv[cut + 1], argv[cut + 2:]
    if args.hub and not args.token_file:
        ap.error("--hub needs --token-file")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    return Supervisor(parse(sys.argv[1:] if argv is None else argv)).run()


if __name__ == "__main__":
    sys.exit(main())
