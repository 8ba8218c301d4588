"""Prometheus view of the hub: read at scrape time from the state machine's counters.

Why a collector and not Counter objects: the hub already keeps its counters (they go
out in ``th status --json`` too); reading them at scrape time keeps one source of truth.
Scrapes run on the HTTP server's thread, so they read through ``status``, a snapshot
taken under the service's lock, never the hub's tables while the loop changes them.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import protocol as p


class HubCollector:
    def __init__(self, status: Callable[[], p.StatusReply]):
        self.status = status

    def collect(self):
        status = self.status()
        ops = CounterMetricFamily("tensorhub_hub_events", "hub events by kind", labels=["kind"])
        for key, value in sorted(status.counters.items()):
            ops.add_metric([key], value)
        yield ops
        eps = GaugeMetricFamily("tensorhub_endpoints", "registered endpoints", labels=["kind"])
        for kind in ("endpoint", "agent"):
            eps.add_metric([kind], sum(1 for e in status.endpoints if e.kind == kind))
        yield eps
        versions = GaugeMetricFamily("tensorhub_versions", "versions known", labels=["state"])
        for state in ("STAGING", "READY", "UNAVAILABLE"):
            versions.add_metric([state], sum(1 for v in status.versions if v.state == state))
        yield versions
        yield GaugeMetricFamily(
            "tensorhub_replicas", "replicas registered", value=sum(v.replicas for v in status.versions)
        )


def serve_metrics(status: Callable[[], p.StatusReply], addr: str, port: int):
    """Serve ``status()`` (thread-safe: ``HubService.status``) as Prometheus metrics."""
    registry = CollectorRegistry()
    registry.register(HubCollector(status))
    return start_http_server(port, addr=addr, registry=registry)
