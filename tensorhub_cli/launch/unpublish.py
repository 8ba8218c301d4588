"""`th unpublish MODEL VERSION [--node NODE]`: an operator withdraws a version.

Protocol. One ``Withdraw`` to the hub (``hub.commands.withdraw``): the hub drains every
targeted replica at once (no new reads; the reads in flight finish first, contract 3),
tells each holder to unpublish it, and answers, deferred, once none is left
(``Withdrawn``, naming who let go), or after ``timeout`` seconds with an
``Error(timeout)`` naming who still holds it and why (its drains go on). Without
``--node`` the whole version goes: retention makes no copy of it and holds no last copy
back. With ``--node`` only that node's replicas go, and retention still applies (a
retained version's last copies wait for one made on another node).

While waiting, the hub's events since the request are followed on a second socket (a
client drops replies to requests it is not waiting for), so a holder's
``unpublish_failed`` report is printed as it comes. Waits: ``timeout`` for the hub's
answer, plus ``call_timeout`` for the answer to arrive (the hub answers at its own
deadline); ``call_timeout`` for each events request. A hub that restarted meanwhile
forgot the withdrawal: the command then fails naming that, and running it again
resumes it.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable
from .operate import Events, OperateError
from .state import cluster_dir, read_token

CALL_TIMEOUT_S = 5.0
POLL_S = 0.2  # between two looks at the hub's events while the withdrawal drains
_BAD_INPUT = ("not_found", "bad_request", "malformed", "conflict")


class UnpublishError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def check_node(cluster: str, node: Optional[str]) -> None:
    """``--node`` must name a node of the cluster's spec (exit 2 otherwise)."""
    if node is None:
        return
    from .. import spec as specmod

    nodes = [n.name for n in specmod.load(cluster_dir(cluster) / "spec.yaml").nodes()]
    if node not in nodes:
        raise UnpublishError(f"--node {node!r} is not in cluster {cluster!r} (nodes: {', '.join(nodes)})", 2)


def unpublish(cluster: str, state, model: str, version: int, node: Optional[str], timeout: float, *,
              call_timeout: float = CALL_TIMEOUT_S, poll_s: float = POLL_S,
              log: Callable[[str], None] = lambda line: None) -> p.Withdrawn:
    """Withdraw ``model@version`` (from ``node``'s holders only, if given); returns the
    hub's ``Withdrawn`` or raises ``UnpublishError`` (code 2: bad input)."""
    check_node(cluster, node)
    token = read_token(cluster)
    asker, watcher = HubClient(state.hub_address, token), HubClient(state.hub_address, token)
    try:
        try:
            since = watcher.call(p.Events(since=1 << 62), timeout=call_timeout).last_seq
        except (HubError, HubUnreachable) as exc:
            raise UnpublishError(str(exc)) from None
        events = Events(watcher, since, call_timeout, log)
        rid = asker.send(p.Withdraw(model=model, version=version, node=node or "", timeout_s=timeout))
        deadline = time.monotonic() + timeout + call_timeout
        while True:
            try:
                body = asker.reply(rid, timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
            except HubError as exc:
                raise UnpublishError(exc.error.message, 2 if exc.code in _BAD_INPUT else 1) from None
            if body is not None:
                return body
            try:
                for e in events.poll():
                    if e.kind == "unpublish_failed" and (e.model, e.version) == (model, version):
                        log(f"{e.endpoint} could not let its copy go: {e.message}")
            except OperateError as exc:  # the answer may still come: only say so
                log(f"following hub events: {exc}")
            if time.monotonic() >= deadline:
                raise UnpublishError(f"no answer from the hub at {state.hub_address} within "
                                     f"{timeout + call_timeout:.0f}s; if it restarted it forgot this withdrawal "
                                     f"(run `th unpublish {model} {version}` again; `th versions {model}` shows "
                                     "who holds it)")
    finally:
        asker.close()
        watcher.close()
