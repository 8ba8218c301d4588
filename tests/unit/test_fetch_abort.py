"""What a failed fetch does before it raises (``fetching.abort``): the partial replica
it withdraws may have served chunks to peers, so it is dropped only once the hub
acknowledged its drain, however long past ``call_timeout_s`` that takes (scenario 6
of "no silent wrong bytes")."""

from __future__ import annotations

import time

import pytest
import torch

from tensorhub_cli.endpoint import fetching
from tensorhub_cli.endpoint.fetch import FetchError
from tensorhub_cli.errors import HubUnreachable
from tensorhub_cli.hub import protocol as p

from .test_registration_cache import CopyFetch, CountingEngine, Hub, bare_endpoint, publish, weights

DRAIN_S = 0.6  # how long peers' pins on the chunks our partial replica served last


class DrainingHub(Hub):
    """Answers the reader's Unpublish only once its (simulated) drain is over: a call
    that gives up earlier sees no answer, as a HubClient would."""

    def __init__(self, log: list):
        super().__init__(log)
        self.asked_at: float | None = None

    def __call__(self, op, timeout):
        if isinstance(op, p.Unpublish) and op.name == "reader":
            self.asked_at = self.asked_at or time.monotonic()
            left = self.asked_at + DRAIN_S - time.monotonic()
            if left > timeout:
                time.sleep(timeout)
                raise HubUnreachable(f"test: no answer within {timeout}s")
            time.sleep(max(0.0, left))
            self.log.append(("drained", op.version))
        return super().__call__(op, timeout)


class ServedThenFailed(CopyFetch):
    def run(self) -> None:
        super().run()  # (every chunk in: peers may have read them)
        raise FetchError("test: failed after serving")

    def stop(self, timeout: float):
        return []


def test_a_failed_fetch_drops_its_replica_only_after_the_hub_drained_it(monkeypatch):
    log: list = []
    hub = DrainingHub(log)
    pub = bare_endpoint(CountingEngine(), hub)
    reader = bare_endpoint(CountingEngine(log), hub)
    reader.name, reader.call_timeout_s, reader.drain_timeout_s = "reader", 0.1, 5.0
    publish(pub, 1, weights(1))
    monkeypatch.setattr(fetching, "Fetch", ServedThenFailed)
    monkeypatch.setattr(fetching, "ScheduledFetch", ServedThenFailed)  # (the job class either way)
    dropped = []
    real_drop = reader.replicas.drop
    monkeypatch.setattr(reader.replicas, "drop", lambda held, **kw: (dropped.append(list(log)), real_drop(held, **kw)))
    with pytest.raises(FetchError, match="failed after serving"):
        reader.fetch("m", 1, into={k: torch.zeros_like(v) for k, v in weights(1).items()}, timeout=5)
    assert dropped and ("drained", 1) in dropped[0], \
        "the partial replica was dropped before the hub acknowledged its drain (peers may still read it)"


class SilentHub(Hub):
    """Answers everything but the reader's Unpublish, which never gets an answer."""

    def __call__(self, op, timeout):
        if isinstance(op, p.Unpublish) and op.name == "reader":
            time.sleep(timeout)
            raise HubUnreachable(f"test: no answer within {timeout}s")
        return super().__call__(op, timeout)


def test_a_failed_fetch_does_not_wait_out_the_drain_bound_for_a_hub_that_answers_nothing(monkeypatch):
    hub = SilentHub([])
    pub = bare_endpoint(CountingEngine(), hub)
    reader = bare_endpoint(CountingEngine(), hub)
    reader.name, reader.call_timeout_s, reader.drain_timeout_s = "reader", 0.1, 30.0
    reader.service.last_error = "test: the hub did not answer our last beat"
    publish(pub, 1, weights(1))
    monkeypatch.setattr(fetching, "Fetch", ServedThenFailed)
    monkeypatch.setattr(fetching, "ScheduledFetch", ServedThenFailed)  # (the job class either way)
    began = time.monotonic()
    with pytest.raises(FetchError, match="failed after serving"):
        reader.fetch("m", 1, into={k: torch.zeros_like(v) for k, v in weights(1).items()}, timeout=5)
    assert time.monotonic() - began < 5, "a failed fetch waited out drain_timeout_s for a hub that is gone"
    assert reader.replicas.all() == []
