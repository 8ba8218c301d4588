"""Collective stages (``fetch(..., collective=pg)``) on gloo: real member processes, each
an endpoint in its own process and a rank of one process group, against a real hub
process and a real publisher process. Every member ends bit-exact and a complete
holder; the group reads about one copy from holders (per member ``last_fetch`` and the
hub's ``bytes_planned``); a member that dies mid-fetch fails the others with an error
naming the stage and the timeout, within the timeout, and no process stays behind.

The members are this module run as a program (``python -m tests.integration.test_collective``),
driven by JSON lines like ``tests/integration/worker.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from tensorhub_cli.bench.rig import Driven, HubProcess
from tensorhub_cli.endpoint import collective
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient

from ..conftest import REPO, free_port
from .peers import Worker

pytestmark = pytest.mark.integration
MIB, CHUNK = 4, 0.25  # four 1 MiB tensors in 256 KiB chunks (16 chunks) plus one chunk of small ones


def test_owners_and_batches_cover_every_chunk_once():
    sizes = [5, 5, 5, 5, 5, 2, 9]
    for members, stripes in ((3, True), (3, False), (7, True)):
        owner = collective.owners(len(sizes), members, stripes)
        assert owner == ([c % members for c in range(7)] if stripes else [0] * 7)
        for limit in (1, 9, 10, 100):
            got = collective.batches(sizes, owner, members, limit)
            sent = [c for b in got for part in b.parts for c in part]
            assert sorted(sent) == list(range(7))
            for b in got:
                assert all(owner[c] == m for m, part in enumerate(b.parts) for c in part)
                assert b.size == max(sum(sizes[c] for c in part) for part in b.parts)
                assert b.size <= max(limit, max(sizes))  # (one round always fits)
    one = collective.batches(sizes, collective.owners(7, 3, True), 3, 100)
    assert len(one) == 1 and one[0].parts == ((0, 3, 6), (1, 4), (2, 5))


def test_collective_takes_only_a_process_group_of_ours():
    from tensorhub_cli import BadArgument
    from tensorhub_cli.engines import dist as coll

    with pytest.raises(BadArgument, match="^collective takes a torch.distributed process group"):
        coll.check_group(object())  # (and this process has none initialized)


class Member(Driven):
    def __init__(self, hub: str, token: str, rank: int, world: int, port: int):
        super().__init__(f"member-{rank}", ["-m", "tests.integration.test_collective", json.dumps(
            {"hub": hub, "token": token, "rank": rank, "world": world, "port": port})], cwd=str(REPO))


@pytest.fixture
def rig():
    """A hub process and a publisher process; ``members(n)`` starts a group of n."""
    started: list[Driven] = []
    with HubProcess(expiry_s=1.0) as hub:
        client = HubClient(hub.address, hub.token)
        publisher = Worker(hub.address, hub.token, "trainer", engine="tcp")
        started.append(publisher)

        def members(n: int) -> list[Member]:
            port = free_port()
            group = [Member(hub.address, hub.token, r, n, port) for r in range(n)]
            started.extend(group)
            for m in group:
                assert m.hello["ready"], m.name
            return group

        try:
            yield publisher, members, client
        finally:
            for proc in started:
                proc.stop()  # (by PID, SIGKILL at the end)
            client.close()
    assert all(proc.proc.poll() is not None for proc in started)


def fetch_all(group: list[Member], timeout: float = 30, **args) -> list[dict]:
    for m in group:
        m.send("fetch", timeout=timeout, **args)
    return [m.recv(timeout + 30) for m in group]


def planned(client: HubClient) -> dict[str, int]:
    return {e.name: e.bytes_planned for e in client.call(p.Status(), timeout=5).endpoints}


def holders(client: HubClient) -> dict[str, bool]:
    (v,) = client.call(p.Versions(model="policy"), timeout=5).versions
    return {h.name: h.complete for h in v.holders}


def test_stripes_read_one_copy_between_the_members_and_all_gather_it(rig):
    publisher, members, client = rig
    n = 3
    chunks = publisher.ask("publish", model="policy", version=1, seed=5, mib=MIB, chunk_mib=CHUNK)["chunks"]
    group = members(n)
    results = fetch_all(group, seed=5)
    assert [r.get("version") for r in results] == [1] * n, results
    assert all(r["equal"] for r in results)  # bit-exact, every member
    total = results[0]["total"]
    for r in results:
        s = r["stats"]
        assert s["collective"] == "stripes" and s["members"] == n
        assert abs(s["bytes"] - total / n) <= CHUNK * 2**20, s  # its stripe: total/n plus chunk rounding
        assert s["bytes"] + s["gathered"] == total and s["corrupt"] == 0
    assert sum(r["stats"]["bytes"] for r in results) == total  # one copy between them, not one each
    hub_planned = planned(client)
    assert sum(hub_planned[m.name] for m in group) == total
    assert all(hub_planned[m.name] == r["stats"]["bytes"] for m, r in zip(group, results))
    assert all(holders(client)[m.name] for m in group)  # each a complete holder, serving
    assert chunks >= n


def test_fewer_chunks_than_members_one_reads_and_broadcasts(rig):
    publisher, members, client = rig
    assert publisher.ask("publish", model="policy", version=1, seed=6, mib=0.01, chunk_mib=CHUNK)["chunks"] == 1
    group = members(2)
    results = fetch_all(group, seed=6, mib=0.01, measure=True)  # (through what a GPU check calls)
    assert all(r.get("version") == 1 and r["equal"] for r in results), results
    assert all(r["measured"]["wall_s"] > 0 and r["measured"]["collective"] == "broadcast" for r in results)
    total = results[0]["total"]
    assert [r["stats"]["collective"] for r in results] == ["broadcast"] * 2
    assert [r["stats"]["bytes"] for r in results] == [total, 0]
    assert [r["stats"]["gathered"] for r in results] == [0, total]
    hub_planned = planned(client)
    assert [hub_planned[m.name] for m in group] == [total, 0]
    assert all(holders(client)[m.name] for m in group)


@pytest.mark.parametrize("stage,how", [("read", "exit"), ("gather", "exit"), ("gather", "hang")])
def test_a_member_that_dies_or_hangs_fails_the_group_within_the_timeout(rig, stage, how):
    publisher, members, client = rig
    publisher.ask("publish", model="policy", version=1, seed=7, mib=MIB, chunk_mib=CHUNK)
    group = members(3)
    timeout = 5.0
    began = time.monotonic()
    group[2].send("fetch", seed=7, timeout=timeout, die_at=stage, how=how)
    results = fetch_all(group[:2], seed=7, timeout=timeout)
    assert time.monotonic() - began < timeout + 5
    if how == "exit":
        assert group[2].proc.wait(timeout=10) == 3  # (it did die, by os._exit, at that stage)
    else:
        group[2].kill()  # (by PID: it sleeps inside that stage)
    for r in results:
        assert r.get("type") == "CollectiveError" and isinstance(r["error"], str), r
        assert f"stage {stage!r}" in r["error"] and "timeout" in r["error"], r
        if how == "hang":  # nothing closed a socket: the deadline ended it
            assert "did not complete within the timeout" in r["error"] and r["elapsed"] >= timeout - 0.5, r
        assert r["elapsed"] < timeout + 1, r
        assert not r["holds"], r  # the destination is no replica of ours
    assert not any(holders(client).get(m.name) for m in group)


# --- the member program ------------------------------------------------------------


def member(args: dict) -> int:
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tensorhub_cli import connect
    from tensorhub_cli.engines import dist as coll
    from tests.integration.worker import make

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['port']}", rank=args["rank"],
                            world_size=args["world"], timeout=timedelta(seconds=60))
    ep = connect(hub=args["hub"], token=args["token"], name=f"member-{args['rank']}", engine="tcp",
                 heartbeat_s=0.2, group="inst-0")
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            ep.close(drain_timeout=cmd.get("drain_timeout", 5))
            print(json.dumps({"closed": True}), flush=True)
            os._exit(0)  # (a process group broken by a dead member may hang an orderly exit)
        want = make(cmd["seed"], cmd.get("mib", MIB))
        into = {k: torch.zeros_like(v) for k, v in want.items()}
        if cmd.get("die_at"):
            run = coll.Collective._run

            def dying(self, stage, start, keep, run=run, at=cmd["die_at"], how=cmd["how"]):
                if stage == at and how == "exit":
                    os._exit(3)
                if stage == at:
                    time.sleep(3600)  # (the test kills us)
                return run(self, stage, start, keep)

            coll.Collective._run = dying
        began = time.monotonic()
        try:
            if cmd.get("measure"):
                measured = collective.measure(ep, dist.group.WORLD, "policy", "latest", into, group="inst-0",
                                              timeout=cmd["timeout"])
                v = measured["version"]
            else:
                measured = None
                v = ep.fetch("policy", "latest", into=into, group="inst-0", timeout=cmd["timeout"],
                             collective=dist.group.WORLD)
            out = {"measured": measured, "version": v, "equal": all(torch.equal(want[k], into[k]) for k in want),
                   "stats": ep.last_fetch, "total": sum(h.placed.views[c].nbytes for h in ep.replicas.all()
                                                       for c in range(len(h.placed.views)))}
        except Exception as exc:
            out = {"error": str(exc), "type": type(exc).__name__, "elapsed": time.monotonic() - began,
                   "holds": bool(ep.replicas)}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(member(json.loads(sys.argv[1])))
