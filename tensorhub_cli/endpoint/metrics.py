"""Per-stage fetch timing: ``Endpoint.last_fetch``'s seconds, and Prometheus histograms.

Protocol. ``stages(started, resolved, set_up, loop, ended)`` turns a fetch's
timestamps (``time.monotonic``) and its loop's split (``Fetch.times``) into the
``*_s`` keys of ``last_fetch``: ``resolve_s`` (naming the version, waiting for it
included), ``setup_s`` (placing the destination, registering memory, draining what
it held), ``plan_wait_s``, ``transfer_s``, ``verify_s`` (the fetch loop, split by
what it waited on) and ``wall_s``; the stages sum to ``wall_s`` up to the few
microseconds between them. Adapters add ``load_s`` (the engine loading the weights)
and ``pause_s`` (the engine's pause to resume).

``observe(stats)`` adds one fetch to the process's histograms
(``th_fetch_stage_seconds{stage}``, ``th_fetch_bytes``). ``serve(port, addr)`` exposes
them on ``/metrics`` (once per process) on ``addr``, the node's address the endpoint
binds (as the hub's metrics bind the hub node's), never every interface: the listener
has no authentication. Opt-in: only ``connect(metrics_port=)`` or the
``TH_METRICS_PORT`` environment variable starts it (``api._serve_metrics``); nothing
sets either by default.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Histogram, start_http_server

STAGES = ("resolve_s", "setup_s", "plan_wait_s", "transfer_s", "verify_s", "load_s", "pause_s", "wall_s")
# Weight syncs take milliseconds (a warm small model) to minutes (a 1T model over a WAN).
_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

REGISTRY = CollectorRegistry()
SECONDS = Histogram("th_fetch_stage_seconds", "Seconds per stage of a fetch or an engine's weight update",
                    ["stage"], buckets=_BUCKETS, registry=REGISTRY)
BYTES = Histogram("th_fetch_bytes", "Bytes one fetch read from holders", registry=REGISTRY,
                  buckets=tuple(float(1 << n) for n in range(10, 44, 2)))
_served: list = []  # the one server of this process
_lock = threading.Lock()


def stages(started: float, resolved: float, set_up: float, loop: dict, ended: float) -> dict:
    return {"resolve_s": resolved - started, "setup_s": set_up - resolved,
            "plan_wait_s": loop.get("plan_wait_s", 0.0), "transfer_s": loop.get("transfer_s", 0.0),
            "verify_s": loop.get("verify_s", 0.0), "wall_s": ended - started}


def observe(stats: dict) -> None:
    for stage in STAGES:
        if stage in stats:
            SECONDS.labels(stage=stage).observe(stats[stage])
    if "bytes" in stats:
        BYTES.observe(stats["bytes"])


def serve(port: int, addr: str) -> int:
    """Expose this process's histograms on ``/metrics`` at ``addr``:``port`` (0: any
    free port); returns the port. A second call returns the first one's port (one
    process, one listener: its first endpoint's address)."""
    with _lock:
        if not _served:
            server, _ = start_http_server(port, addr=addr, registry=REGISTRY)
            _served.append(server)
        return _served[0].server_port


def shutdown() -> None:
    """Stop serving (tests: a process otherwise serves until it exits)."""
    with _lock:
        while _served:
            server = _served.pop()
            server.shutdown()
            server.server_close()
