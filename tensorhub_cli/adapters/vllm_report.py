"""What a vLLM user sees of the backend (``adapters.vllm``): one INFO line per update
through vLLM's own logger, and the adapter's metrics in vLLM's Prometheus registry.

Protocol. ``vlog()``: the logger under vLLM's tree (``vllm.tensorhub``), formatted as
vLLM's. ``summary(model, metrics)``: the one line per update (version, bytes, where
from, each stage, the pause; "no update (it failed)" for empty metrics).
``expose_metrics()``: once per process, the adapter's histograms
(``endpoint.metrics.REGISTRY``) also in prometheus_client's default registry, the one
vLLM's ``/metrics`` serves where the worker shares its process. Needs vLLM only for
``vlog``.
"""

from __future__ import annotations

import logging

SHARD_STAGES = ("take_s", "wait_s", "fetch_in_pause_s", "copy_s", "process_s", "prepared_s", "load_s", "between_s",
                "finish_s", "pause_s")
WHOLE_STAGES = ("resolve_s", "setup_s", "plan_wait_s", "transfer_s", "verify_s", "load_s", "pause_s")


def vlog() -> logging.Logger:
    """vLLM's own logger tree (``vllm.*``): what a vLLM user sees, formatted as vLLM's."""
    from vllm.logger import init_logger

    return init_logger("vllm.tensorhub")


def summary(model: str, m: dict) -> str:
    """The one line per update: version, bytes, where from, each stage, the pause."""
    if not m:
        return f"{model}: no update (it failed)"
    stages = SHARD_STAGES if m.get("path") == "shard" else WHOLE_STAGES
    where = f"{m.get('reads', 0)} reads, {m.get('from_publishers', 0)} from publishers"
    shard = f" of a {m['shard_bytes']} B shard" if "shard_bytes" in m else " (whole model)"
    fetched = (" in the pause" if m.get("fetch_in_pause") else f" before the pause ({m.get('prefetch_s', 0.0):.3f}s)") \
        if m.get("path") == "shard" else ""
    return (f"loaded {model}@{m.get('version')}: read {m.get('bytes', 0)} B{shard}{fetched}, {where}; "
            + ", ".join(f"{s}={m[s]:.3f}" for s in stages if isinstance(m.get(s), float)))


def expose_metrics() -> None:
    """The adapter's histograms (``endpoint.metrics``) also in prometheus_client's
    default registry, the one vLLM's ``/metrics`` serves where the worker shares its
    process (an in-process engine core); once per process."""
    import prometheus_client

    from ..endpoint.metrics import REGISTRY

    class Ours:
        def collect(self):
            yield from REGISTRY.collect()

    if not getattr(prometheus_client.REGISTRY, "_tensorhub", False):
        prometheus_client.REGISTRY.register(Ours())
        prometheus_client.REGISTRY._tensorhub = True
