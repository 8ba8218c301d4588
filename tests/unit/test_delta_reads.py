"""``endpoint.delta_reads.DeltaReads``: a delta read released while in flight writes
nothing into the chunk's memory afterwards (the fetch may read that chunk again there);
one that fails says why; ``when_over`` is called once either way."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from tensorhub_cli import delta
from tensorhub_cli.endpoint import delta_reads as dr
from tensorhub_cli.engines import wire

ASK = dr.DeltaAsk(address="127.0.0.1:1", token="t", model="m", version=2, base=1, index=0, timeout=5.0)


def _chunks():
    old = torch.arange(4096, dtype=torch.int16).view(torch.uint8)
    new = old.clone()
    new[100] ^= 1
    return old, new, delta.encode(old, new)


def _run(monkeypatch, answer, release_first: bool):
    gate = threading.Event()

    def fake(*args, **kwargs):
        gate.wait(5)
        return answer()

    monkeypatch.setattr(wire, "read_delta", fake)
    old, _, _ = _chunks()
    into = torch.zeros_like(old)
    with ThreadPoolExecutor(1) as pool:
        reads = dr.DeltaReads(pool)
        x = reads.start(ASK, old, into)
        ended = []
        reads.when_over(x, ended.append)
        assert reads.state(x) == "pending" and not ended
        released = reads.release(x) if release_first else None
        gate.set()
    return x, into, ended, released, reads


def test_a_landed_delta_is_rebuilt_into_the_chunks_memory(monkeypatch):
    _, new, payload = _chunks()
    x, into, ended, _, reads = _run(monkeypatch, lambda: (bytearray(payload), False), release_first=False)
    assert ended == ["done"] and torch.equal(into, new) and x.wire_bytes == len(payload)
    assert reads.release(x) is True


def test_a_delta_released_in_flight_writes_nothing_after_release(monkeypatch):
    _, _, payload = _chunks()
    x, into, ended, released, reads = _run(monkeypatch, lambda: (bytearray(payload), False), release_first=True)
    assert released is False  # it was still in flight: the caller waits for when_over
    assert ended == ["done"] and not into.any(), "a released read wrote into the chunk"
    assert reads.release(x) is True


def test_a_delta_against_other_bytes_fails_naming_why_and_writes_nothing(monkeypatch):
    other = torch.ones(8192, dtype=torch.uint8)
    new = other.clone()
    new[5] = 9
    payload = delta.encode(other, new)  # made against bytes the reader does not hold
    x, into, ended, _, _ = _run(monkeypatch, lambda: (bytearray(payload), False), release_first=False)
    assert ended == ["failed"] and "other old bytes" in x.error and not into.any()


def test_a_refusing_holder_fails_the_read(monkeypatch):
    def refuse():
        raise wire.PeerError("holder refused: not_found")

    x, into, ended, _, _ = _run(monkeypatch, refuse, release_first=False)
    assert ended == ["failed"] and "not_found" in x.error and not into.any()
