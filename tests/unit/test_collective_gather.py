"""The gather stage of a collective fetch, with a stand-in for the process group:
a member's own failure between batches never changes the sequence of collective
calls it makes (scenario 7 of "no silent wrong bytes"), and what others sent is hashed
only once its copy into the destination's device is done."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tensorhub_cli.endpoint import collective, streams
from tensorhub_cli.endpoint.replica import Replica
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.layout import lay_out, place

CHUNK = 1 << 12


def source() -> dict:
    g = torch.Generator().manual_seed(3)
    return {f"w{i}": torch.randn(4096, generator=g) for i in range(4)}  # 16 KiB each: 16 chunks


class Group:
    """Two members; we are rank 0. Rank 1 sends its stripe of the source's chunks."""

    def __init__(self, peer_views: list, log: list):
        self.size, self.rank, self.device = 2, 0, torch.device("cpu")
        self.deadline = time.monotonic() + 30
        self.peer_views, self.log = peer_views, log

    def all_gather(self, stage: str, buf: torch.Tensor) -> list:
        self.log.append(("all_gather", stage, buf.numel()))
        theirs = torch.empty_like(buf)
        at = 0
        for c in self.batch_parts.pop(0)[1]:
            n = self.peer_views[c].nbytes
            theirs[at:at + n].copy_(self.peer_views[c])
            at += n
        return [buf, theirs]

    def broadcast(self, stage: str, buf: torch.Tensor, src: int) -> None:
        raise AssertionError("two members with stripes all-gather")


def member(log: list, *, device: int = -1) -> collective.Member:
    manifest, published = lay_out(source(), CHUNK, 0)
    into = {k: torch.zeros_like(v) for k, v in source().items()}
    placed = place([manifest], into)
    placed.device = device  # (a CUDA destination's bookkeeping; the bytes stay on the host here)
    held = Replica(model="m", version=1, world=1, shards=[manifest], rank=-1, placed=placed, handle=None)
    pool = ThreadPoolExecutor(1)
    real_submit = pool.submit
    pool.submit = lambda fn, c: (log.append(("hash", c)), real_submit(fn, c))[1]
    ep = SimpleNamespace(name="m0", incarnation="i", call_timeout_s=1.0, verifiers=pool,
                         call=lambda op, timeout: p.Ok())
    comm = Group(published.views, log)
    me = collective.Member(ep, comm)
    me.held = held
    sizes = [v.nbytes for v in placed.views]
    comm.batch_parts = [(b.parts[0], b.parts[1]) for b in collective.batches(
        sizes, collective.owners(len(sizes), 2, True), 2, 2 * CHUNK)]
    for c in range(0, len(sizes), 2):  # our own stripe, read from holders already
        placed.views[c].copy_(published.views[c])
        me.have.add(c)
    return me


def test_a_member_whose_own_work_fails_mid_gather_still_makes_every_collective_call(monkeypatch):
    log: list = []
    me = member(log)
    batches = len(me.comm.batch_parts)
    assert batches >= 3, "the test needs several batches"
    calls = {"n": 0}
    real_pack = collective._pack

    def pack_fails_on_the_second(buf, views):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("test: a copy failed")
        real_pack(buf, views)

    monkeypatch.setattr(collective, "_pack", pack_fails_on_the_second)
    with pytest.raises(RuntimeError, match="a copy failed"):
        collective._gather(me, 4 * CHUNK)
    gathers = [e for e in log if e[0] == "all_gather"]
    assert len(gathers) == batches, \
        f"the failing member left after {len(gathers)} of {batches} batches: the others would wait in a batch"


def test_what_others_sent_is_hashed_only_after_the_destination_device_is_synchronized(monkeypatch):
    log: list = []
    me = member(log, device=0)
    monkeypatch.setattr(streams, "_streams", SimpleNamespace(synchronize=lambda d: log.append(("synchronize", d)),
                                                             current_stream=lambda d: SimpleNamespace(),
                                                             event=lambda d: SimpleNamespace(
                                                                 record=lambda s: None)))
    assert collective._gather(me, 4 * CHUNK) == []
    first_hash = next(i for i, e in enumerate(log) if e[0] == "hash")
    assert ("synchronize", 0) in log[:first_hash], \
        "chunks copied into a CUDA destination were hashed before the copy was synchronized"
    assert all(torch.equal(v, w) for v, w in zip(me.held.placed.views, me.comm.peer_views))
