"""Stream order (``endpoint.streams``) on a machine without a GPU: a recording stand-in
for torch's CUDA calls replaces the ``_streams`` hook, and the tests check that
``publish`` waits for the tensors' pending work before it hashes and registers them,
and that a fetch's scatters are followed by an event its caller's stream waits on
before ``fetch`` returns. What a GPU run must still confirm: docs in ``streams``."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tensorhub_cli import BadArgument
from tensorhub_cli.endpoint import fetching, publishing
from tensorhub_cli.endpoint import streams
from tensorhub_cli.endpoint.fetch import Fetch
from tensorhub_cli.endpoint.inflight import Reading
from tensorhub_cli.endpoint.replica import Replica
from tensorhub_cli.layout import Placed, lay_out, place

from .test_registration_cache import CopyFetch, CountingEngine, Hub, bare_endpoint, publish, weights


class Recorder:
    """Torch's CUDA stream calls, written down in one log with everything else."""

    def __init__(self, log: list):
        self.log = log

    def current_stream(self, device: int):
        return Stream(self.log, f"{threading.current_thread().name}/{device}")

    def synchronize(self, device: int) -> None:
        self.log.append(("synchronize", device))

    def event(self, device: int):
        return Event(self.log, device)


class Stream:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def wait_event(self, event) -> None:
        self.log.append(("wait", self.name, event))


class Event:
    def __init__(self, log: list, device: int = -1):
        self.log, self.device = log, device

    def record(self, stream) -> None:
        self.log.append(("record", stream.name, self))

    def synchronize(self) -> None:
        self.log.append(("host waits", self))


@pytest.fixture
def log(monkeypatch):
    """One log for the stream calls, the engine, the hub, hashing and scatters."""
    log: list = []
    monkeypatch.setattr(streams, "_streams", Recorder(log))
    real_lay_out, real_finish = publishing.lay_out, Placed.finish

    def lay_out_logged(*a, **kw):
        log.append(("lay_out",))
        return real_lay_out(*a, **kw)

    def finish_logged(self, chunk):
        if chunk in self.scatter:
            log.append(("scatter", chunk))
        return real_finish(self, chunk)

    monkeypatch.setattr(publishing, "lay_out", lay_out_logged)
    monkeypatch.setattr(Placed, "finish", finish_logged)
    monkeypatch.setattr(fetching, "Fetch", CopyFetch)
    monkeypatch.setattr(fetching, "ScheduledFetch", CopyFetch)  # (the job class either way)
    CopyFetch.source = {}
    return log


def kinds(log: list) -> list[str]:
    return [entry[0] if entry[0] != "hub" else f"hub {entry[1]}" for entry in log]


def test_publish_waits_for_the_current_stream_before_hashing_and_registering(log):
    ep = bare_endpoint(CountingEngine(log), Hub(log))
    publish(ep, 1, weights(1))
    # first the caller's work; then our copies into staging, before the hub lets readers in
    assert kinds(log) == ["synchronize", "lay_out", "register", "synchronize", "hub Publish"]
    assert [e[1] for e in log if e[0] == "synchronize"] == [-1, -1]  # the tensors' device (host here)


def test_publish_with_ready_events_waits_for_them_instead(log):
    ep = bare_endpoint(CountingEngine(log), Hub(log))
    first, second = Event(log), Event(log)
    ep.publish("m", 1, {"w": torch.randn(4096)}, ready=[first, second])  # no small tensors: no staging
    assert kinds(log) == ["host waits", "host waits", "lay_out", "register", "hub Publish"]
    assert [e[1] for e in log[:2]] == [first, second]
    log.clear()
    ep.publish("m", 2, {"v": torch.randn(4096)}, ready=first)  # one event
    assert kinds(log) == ["host waits", "lay_out", "register", "hub Publish"]


def test_a_bad_ready_is_named_and_nothing_is_registered(log):
    ep = bare_endpoint(CountingEngine(log), Hub(log))
    with pytest.raises(BadArgument, match="ready"):
        ep.publish("m", 1, weights(1), ready=[object()])
    assert kinds(log) == [] and not ep.replicas


def test_fetch_makes_its_callers_stream_wait_for_the_last_scatter_before_returning(log):
    pub = bare_endpoint(CountingEngine(), Hub(log))
    reader = bare_endpoint(CountingEngine(), pub.call)
    publish(pub, 1, weights(1))
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    log.clear()
    reader.fetch("m", 1, into=into)
    steps = kinds(log)
    last_scatter = max(i for i, k in enumerate(steps) if k == "scatter")
    record = [e for e in log[last_scatter:] if e[0] == "record"]
    waits = [e for e in log[last_scatter:] if e[0] == "wait"]
    assert record and waits, steps
    me = f"{threading.current_thread().name}/-1"
    assert waits[-1][1] == me and waits[-1][2] is record[-1][2]  # the caller's stream, the last event
    assert steps.index("wait", last_scatter) > steps.index("record", last_scatter)
    log.clear()
    reader.fetch("m", 1, into=into)  # already held (filled by a fetch elsewhere): waits on it again
    assert [e[0] for e in log if e[0] != "hub"] == ["wait"] and log[-1][2] is record[-1][2]


def test_the_fetch_loop_records_an_event_after_each_scatter(log):
    """The real loop's piece (``Fetch._poll``): reads done, hashed, scattered."""
    sd = weights(1)
    manifest, source = lay_out(sd, 1 << 20, 1 << 10)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    placed = place([manifest], into)
    held = Replica(model="m", version=1, world=1, shards=[manifest], rank=-1, placed=placed, handle=None)
    done = SimpleNamespace(state=lambda xfer: "done", release=lambda xfer: True)
    with ThreadPoolExecutor(1) as verifiers:
        job = Fetch(SimpleNamespace(verifiers=verifiers), held, time.monotonic() + 10, 4, read_timeout=5,
                    plan_timeout=5, describe_timeout=5)
        for c, view in enumerate(placed.views):
            view.copy_(source.views[c])  # (what the engine wrote)
            job.inflight[c] = Reading("pub", done, object(), time.monotonic())
        deadline = time.monotonic() + 10
        while len(held.held) < len(placed.views):
            assert time.monotonic() < deadline, "chunks not verified within 10s"
            job._poll()
    steps = kinds(log)
    assert steps.count("scatter") == len(placed.scatter) >= 1
    for i, k in enumerate(steps):
        if k == "scatter":
            assert steps[i + 1] == "record", steps
    assert held.written is log[max(i for i, k in enumerate(steps) if k == "record")][2]
    assert all(torch.equal(into[k], v) for k, v in sd.items())


def test_dropping_a_replica_waits_for_its_scatters_on_the_host(log):
    pub = bare_endpoint(CountingEngine(), Hub(log))
    reader = bare_endpoint(CountingEngine(), pub.call)
    publish(pub, 1, weights(1))
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    reader.fetch("m", 1, into=into)
    written = reader.replicas.get(("m", 1)).written
    log.clear()
    reader.unpublish("m", 1)  # its staging goes back to the cache, where an engine may write it again
    assert ("host waits", written) in log
