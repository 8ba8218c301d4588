"""Per-stage timing of a fetch: present in ``last_fetch``, summing to its wall time,
and counted in the endpoint's Prometheus histograms (served on /metrics)."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from tensorhub_cli.endpoint import connect, metrics

from .test_hub_service import TOKEN, running_hub, token_file  # noqa: F401 (a fixture)

STAGES = ("resolve_s", "setup_s", "plan_wait_s", "transfer_s", "verify_s")


@pytest.fixture
def hub(token_file):
    with running_hub(token_file) as (address, _, _):
        yield address


def count(stage: str) -> float:
    return metrics.REGISTRY.get_sample_value("th_fetch_stage_seconds_count", {"stage": stage}) or 0.0


def test_stages_sum_to_the_wall_time_and_reach_the_histograms(hub):
    kw = dict(engine="tcp", chunk_bytes=256 << 10, heartbeat_s=0.2)
    with connect(hub, TOKEN, name="pub", **kw) as pub, connect(hub, TOKEN, name="rd", **kw) as rd:
        pub.publish("m", 1, {"w": torch.randn(1024, 1024)})
        before = {s: count(s) for s in STAGES}
        rd.fetch("m", 1, into={"w": torch.zeros(1024, 1024)}, timeout=30)
        got = rd.last_fetch
        assert all(got[s] >= 0 for s in STAGES), got
        assert got["transfer_s"] > 0 and got["wall_s"] > 0
        # a partition of the wall time, up to the instants between stages
        assert abs(sum(got[s] for s in STAGES) - got["wall_s"]) <= 0.05 * got["wall_s"] + 0.005, got
        assert all(count(s) == before[s] + 1 for s in STAGES)


def test_metrics_port_serves_the_histograms():
    port = metrics.serve(0, "127.0.0.1")
    assert metrics.serve(0, "127.0.0.1") == port  # once per process
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "th_fetch_stage_seconds" in body
