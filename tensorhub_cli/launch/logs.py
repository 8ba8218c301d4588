"""``th logs``: a cluster's process logs, read through the launcher that started them
(ssh tails, local files, Ray's), each line prefixed with its process's name; with
``follow``, one stream per process, interleaved as lines arrive."""

from __future__ import annotations

import threading
import time

from .launchers import launcher_for
from .procs import endpoint_name
from .state import ClusterState, cluster_dir


def logs(name: str, state: ClusterState, node: str, lines: int, follow: bool, write) -> None:
    """Write the logs of the processes on ``node`` (or of role ``node``, e.g. ``hub``)."""
    recs = [r for r in state.procs if r.node == node or r.role == node]
    if not recs:
        raise LookupError(f"no process on node {node!r} in cluster {name!r} "
                          f"(nodes: {', '.join(sorted({r.node for r in state.procs}))})")
    launcher = launcher_for(state.launcher, None, cluster_dir(name))
    try:
        if follow and len(recs) > 1:  # one stream each, interleaved as lines arrive
            threads = [threading.Thread(target=launcher.logs, daemon=True,
                                        args=(r, lines, True, _prefixed(write, endpoint_name(r))))
                       for r in recs]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                time.sleep(0.2)
        else:
            for r in recs:
                launcher.logs(r, lines, follow, _prefixed(write, endpoint_name(r)))
    finally:
        launcher.close()


def _prefixed(write, label: str):
    unended = [""]  # the line begun, not yet ended

    def emit(text: str) -> None:
        *done, unended[0] = (unended[0] + text).split("\n")
        for line in done:
            write(f"{label}: {line}\n")

    return emit
