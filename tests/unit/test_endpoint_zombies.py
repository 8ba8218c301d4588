"""``Zombies`` without a hub: who may send the ``Cancel`` that unpins stopped reads,
and what a re-registration carries of reads still running (contract 3)."""

from __future__ import annotations

import time

import pytest

from tensorhub_cli.endpoint.fetch import FetchError
from tensorhub_cli.endpoint.inflight import Zombie
from tensorhub_cli.endpoint.zombies import Zombies
from tensorhub_cli.errors import HubUnreachable
from tensorhub_cli.hub import protocol as p

MANIFEST = p.Manifest(chunk_bytes=4, tensors=[], chunks=[p.ChunkMeta(nbytes=4, checksum=0)] * 2)


class Engine:
    """Confirms a stop only once the test says so."""

    def __init__(self):
        self.stopped = False

    def release(self, xfer) -> bool:
        return self.stopped


class Calls(list):
    def __call__(self, op, timeout):
        self.append(op)
        return p.Ok()


def zombie(engine, chunk: int) -> Zombie:
    return Zombie(engine, object(), "m", 1, p.Read(chunk=chunk, source="pub"), 1, (MANIFEST,))


@pytest.fixture
def rig():
    replicas: dict = {}
    engine, withdrawals = Engine(), Calls()
    zs = Zombies("reader", "inc", replicas.get, 1.0, hub_call=withdrawals)
    return zs, replicas, engine, withdrawals


def test_a_reregistration_carries_running_zombies_and_their_replica_is_withdrawn_once_they_stop(rig):
    zs, _, engine, withdrawals = rig
    zs.add(zombie(engine, 0), zombie(engine, 1), origin="old fetch")
    (h,) = zs.holdings()
    assert (h.model, h.version, h.world, h.rank, h.held) == ("m", 1, 1, -1, [])
    assert [(r.chunk, r.source) for r in h.reading] == [(0, "pub"), (1, "pub")] and h.shards == [MANIFEST]
    calls = Calls()
    zs.reap(calls)
    assert calls == [] and not zs.idle()  # still running: still pinned
    engine.stopped = True
    zs.reap(calls)
    assert [type(op) for op in calls] == [p.Cancel]
    deadline = time.monotonic() + 5
    while not zs.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [type(op) for op in withdrawals] == [p.Unpublish] and zs.idle()


def test_no_cancel_unpins_the_reads_of_a_newer_fetch_of_the_same_version(rig):
    zs, replicas, engine, withdrawals = rig
    zs.add(zombie(engine, 0), origin="old fetch")
    engine.stopped = True
    replicas[("m", 1)] = "new fetch"  # registered after the old one's record was dropped
    calls = Calls()
    zs.reap(calls)
    assert calls == [] and zs.idle()


def test_the_failed_fetch_still_letting_go_does_not_keep_its_own_reads_pinned(rig):
    zs, replicas, engine, _ = rig
    replicas[("m", 1)] = "old fetch"  # its abort has not dropped its record yet
    zs.add(zombie(engine, 0), origin="old fetch")
    engine.stopped = True
    calls = Calls()
    zs.reap(calls)
    assert [type(op) for op in calls] == [p.Cancel]  # before: skipped, the pin stayed until deregistration


def test_a_new_fetch_waits_for_running_zombies_and_sends_a_pending_cancel_itself(rig):
    zs, _, engine, withdrawals = rig
    zs.add(zombie(engine, 0), origin="old fetch")
    zs.holdings()  # a re-registration pinned it again: the hub made a replica of ours
    with pytest.raises(FetchError, match="m@1"):
        zs.wait_for(("m", 1), [], time.monotonic() + 0.1, Calls())
    engine.stopped = True

    def unreachable(op, timeout):
        raise HubUnreachable("test: no answer")

    zs.reap(unreachable)  # stopped, but its Cancel did not get through: due at the next beat
    calls = Calls()
    zs.wait_for(("m", 1), [], time.monotonic() + 5, calls)  # not a beat later: it cancels them itself
    assert [type(op) for op in calls] == [p.Cancel] and zs.idle()
    assert withdrawals == [], "the new fetch takes that replica over: withdrawing it would refuse its plans"
