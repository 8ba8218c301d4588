"""Schedules (``Plan.schedule``, hub/scheduling.py, planner/schedule.py): one plan per
reader gives every chunk a source, trees within a DC, each chunk crossing a DC once."""

from __future__ import annotations

import msgspec

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.planner.schedule import Swarms, deal

from .hubkit import EXPIRY, info, manifest, new_hub, reg, sends

MODEL = "m"


def _published(nchunks=16, readers=7, dcs=("dc1",)):
    hub = new_hub()
    reg(hub, 0.0, info("t0", node="t", rack="rt", dc="dc1"))
    names = []
    for i in range(readers):
        dc = dcs[i % len(dcs)]
        names.append(f"r{i}")
        reg(hub, 0.0, info(f"r{i}", node=f"n{i}", rack=f"rk{i % 2}-{dc}", dc=dc))
    hub.publish(0.0, p.Publish(name="t0", model=MODEL, version=1, manifest=manifest(nchunks), rank=0, world=1))
    return hub, names


def _schedule(hub, name, want=0, **kw):
    mask = want.to_bytes((want.bit_length() + 7) // 8, "little") if want else b""
    return _expanded(hub.plan(0.0, p.Plan(name=name, model=MODEL, version=1, schedule=True, want=mask, **kw)))


def _expanded(got: p.Planned) -> p.Planned:
    """A scheduled answer with its feeds as reads, one by one (``Planned.listed``)."""
    assert not got.reads, "a scheduled plan lists its reads a source at a time"
    return msgspec.structs.replace(got, reads=got.listed(), feeds=[])


def test_deal_spreads_any_want_evenly_over_the_stripes():
    want = sum(1 << c for c in range(0, 64, 32)) | ((1 << 10) - 1) << 40  # uneven shape
    stripes = deal(want, 2)
    assert stripes[0] | stripes[1] == want and not stripes[0] & stripes[1]
    assert abs(stripes[0].bit_count() - stripes[1].bit_count()) <= 1


def test_swarm_trees_are_breadth_first_and_no_member_feeds_more_than_k():
    swarms = Swarms(k=2)
    parents = [swarms.join(f"r{i}", "dc1", (1 << 8) - 1, lambda n: True) for i in range(9)]
    # the first member takes both stripes from the roots, and feeds the second its other stripe
    assert [par for _, par in parents[0]] == [None, None]
    assert [par for _, par in parents[1]] == ["r0", "r0"]
    children: dict[str, int] = {}
    for got in parents[1:]:
        for _, par in got:
            if par is not None:
                children[par] = children.get(par, 0) + 1
    assert children.pop("r0") <= 3 and max(children.values()) <= 2  # (r0: k, and one in the other stripe)
    # member i is interior in stripe i % 2 only: it feeds no one in the other stripe
    for i in range(1, 9):
        fed = {s for got in parents for s, (_, par) in enumerate(got) if par == f"r{i}"}
        assert fed <= {i % 2}, (i, fed)


def test_one_plan_gives_every_chunk_a_source_and_chunks_flow_down_trees():
    hub, names = _published(nchunks=16, readers=7)
    from_trainer = 0
    parents: dict[tuple[str, int], str] = {}
    for name in names:
        got = _schedule(hub, name)
        assert sorted(r.chunk for r in got.reads) == list(range(16)), f"{name}: not every chunk scheduled"
        for r in got.reads:
            parents[(name, r.chunk)] = r.source
            assert r.ready == (r.source == "t0"), f"{name}: chunk {r.chunk} from {r.source} ready={r.ready}"
            from_trainer += r.source == "t0"
    # the trainer sends the swarm one copy: the first reader feeds the first interior
    # member of the other stripe too
    assert from_trainer == 16
    # acyclic: every chunk's chain of parents ends at the trainer
    for (name, chunk), src in parents.items():
        seen = {name}
        while src != "t0":
            assert src not in seen, f"cycle on chunk {chunk}: {seen}"
            seen.add(src)
            src = parents[(src, chunk)]
    # each reader uploads at most what it downloads (the first, half more: the other stripe's first interior)
    up: dict[str, int] = {}
    for src in parents.values():
        up[src] = up.get(src, 0) + 1
    assert up["r0"] <= 16 + 8 and all(up.get(n, 0) <= 16 for n in names[1:]), up


def test_a_scheduled_read_becomes_ready_once_its_parent_reports_the_chunk():
    hub, names = _published(nchunks=4, readers=2)
    _schedule(hub, "r0")
    got = _schedule(hub, "r1")
    waiting = [r for r in got.reads if not r.ready]
    assert waiting and all(r.source == "r0" for r in waiting)
    hub.progress(0.0, p.Progress(name="r0", model=MODEL, version=1, chunks=[r.chunk for r in waiting]))
    again = _schedule(hub, "r1")
    assert all(r.ready for r in again.reads if r.source == "r0")


def test_a_failed_tree_read_goes_to_a_holder_that_has_the_chunk_now():
    hub, names = _published(nchunks=4, readers=2)
    _schedule(hub, "r0")
    got = _schedule(hub, "r1")
    lost = next(r for r in got.reads if r.source == "r0")
    again = _schedule(hub, "r1", failed=[p.Read(chunk=lost.chunk, source="r0")])
    moved = next(r for r in again.reads if r.chunk == lost.chunk)
    assert moved.source == "t0" and moved.ready  # roots only: never another tree parent


def test_an_expired_source_has_each_reader_it_fed_told_to_replan_and_the_answer_moves_its_chunks():
    """Contract 6: a source that stops beating fails no read by itself (a link that went
    down resets nothing), so the hub tells the readers it fed, and only them."""
    hub, names = _published(nchunks=4, readers=3)
    _schedule(hub, "r0")
    fed = [r for r in _schedule(hub, "r1").reads if r.source == "r0"]
    assert fed, "r1 was scheduled nothing from r0: the test tests nothing"
    _schedule(hub, "r2")
    v = hub.models[MODEL][1]
    expected = {r for r, feeds in v.feeds.items() if "r0" in feeds}
    assert expected and expected < {"t0", *names}
    hub.take_outbound()
    for name in ("t0", "r1", "r2"):  # (every one but r0 beats on)
        hub.heartbeat(EXPIRY / 2, p.Heartbeat(name=name))
    assert hub.expire(EXPIRY + 0.1) == ["r0"]
    told = [(e.endpoint, e.body.model, e.body.version) for e in sends(hub.take_outbound(), "replan")]
    assert sorted(told) == sorted((r, MODEL, 1) for r in expected), told
    again = _expanded(hub.plan(EXPIRY + 0.2, p.Plan(name="r1", model=MODEL, version=1, schedule=True))).reads
    assert {r.chunk for r in again} >= {r.chunk for r in fed}
    assert all(r.source != "r0" for r in again)


def test_each_chunk_crosses_into_a_dc_once_and_the_crossing_is_striped():
    hub, names = _published(nchunks=16, readers=8, dcs=("dc1", "dc2"))
    far = [n for i, n in enumerate(names) if i % 2]
    crossings: dict[int, set[str]] = {}
    half = (1 << 8) - 1
    for i, name in enumerate(far):  # two TP ranks: two swarms in dc2
        got = _schedule(hub, name, want=half << (8 * (i % 2)))
        for r in got.reads:
            if r.source in ("t0",) or hub.endpoints[r.source].place.dc == "dc1":
                crossings.setdefault(r.chunk, set()).add(name)
    assert sorted(crossings) == list(range(16))
    assert all(len(who) == 1 for who in crossings.values()), crossings
    assert len({n for who in crossings.values() for n in who}) >= 2  # more than one seed crosses


def test_every_scheduled_read_is_pinned_and_a_report_unpins_it():
    hub, names = _published(nchunks=4, readers=2)
    _schedule(hub, "r0")
    got = _schedule(hub, "r1")
    v = hub.models[MODEL][1]
    assert {c: v.source_of("r1", c) for c in range(4)} == {r.chunk: r.source for r in got.reads}
    pins = dict(v.pins)
    hub.progress(0.0, p.Progress(name="r1", model=MODEL, version=1, chunks=[got.reads[0].chunk]))
    assert v.source_of("r1", got.reads[0].chunk) is None
    assert v.pins.get(got.reads[0].source, 0) == pins[got.reads[0].source] - 1


def test_a_joiner_of_a_replicated_version_reads_it_from_readers_even_beside_the_trainer():
    hub, names = _published(nchunks=4, readers=2)
    reg(hub, 0.0, info("j", node="t", rack="rt", dc="dc1"))  # on the trainer's own node
    _schedule(hub, "r0")
    hub.progress(0.0, p.Progress(name="r0", model=MODEL, version=1, chunks=[0, 1, 2, 3]))
    got = _schedule(hub, "j", want=0b0011)  # another slice: a swarm of its own, fed by the roots
    assert {r.source for r in got.reads} == {"r0"}, got.reads


def _sharded(world=4, per=2, readers=8, far_publisher=False):
    """A trainer of ``world`` ranks (``per`` chunks each) and readers that want it all."""
    hub = new_hub()
    for r in range(world):
        reg(hub, 0.0, info(f"t{r}", node=f"t{r}", rack="rt", dc="dc2" if far_publisher and r == world - 1 else "dc1"))
    for i in range(readers):
        reg(hub, 0.0, info(f"r{i}", node=f"n{i}", rack=f"rk{i % 2}", dc="dc1"))
    for r in range(world):
        hub.publish(0.0, p.Publish(name=f"t{r}", model=MODEL, version=1, manifest=manifest(per, salt=r + 1), rank=r,
                                   world=world))
    return hub


def test_a_sharded_trainer_feeds_chains_side_by_side_each_from_its_own_head():
    hub = _sharded(world=4, per=2, readers=8)
    plans = {f"r{i}": _schedule(hub, f"r{i}") for i in range(8)}
    # each publisher holds 1/4 of what the swarm wants: it can feed 4 heads at full rate
    for i in range(4):
        assert all(r.source.startswith("t") and r.ready for r in plans[f"r{i}"].reads), plans[f"r{i}"].reads
    for i in range(4, 8):  # then each joiner goes behind its chain's tail
        assert {r.source for r in plans[f"r{i}"].reads} == {f"r{i - 4}"}
    # the heads start on different publishers; a chain's members read in their head's order
    firsts = [plans[f"r{i}"].first for i in range(8)]
    assert len(set(firsts[:4])) == 4 and firsts[4:] == firsts[:4], firsts
    # the heads read one chunk at a time (each lands a chunk time after the last, for
    # its child to take); the members behind them read from one relay anyway
    assert [plans[f"r{i}"].serial for i in range(8)] == [True] * 4 + [False] * 4
    sent: dict[str, int] = {}
    for got in plans.values():
        for r in got.reads:
            sent[r.source] = sent.get(r.source, 0) + 1
    assert all(sent[f"t{r}"] == 4 * 2 for r in range(4)), sent  # 4 copies of each 2-chunk shard


def test_one_chain_where_a_publisher_of_the_want_is_in_another_dc():
    hub = _sharded(world=4, per=2, readers=4, far_publisher=True)
    plans = [_schedule(hub, f"r{i}") for i in range(4)]
    assert [{r.source for r in got.reads} for got in plans[1:]] == [{"r0"}, {"r1"}, {"r2"}]
    assert {got.first for got in plans} == {0}
    assert not any(got.serial for got in plans), "across a DC link one read may not fill it: the whole window"


def test_a_chain_whose_tail_is_gone_gets_a_new_head():
    swarms = Swarms(k=1)
    alive = {"a", "b"}
    got = [swarms.join(n, "dc1", 0b1111, lambda x: x in alive, chains=lambda: 2) for n in ("a", "b", "c", "d")]
    assert [g[0][1] for g in got] == [None, None, "a", "b"]  # c follows a, d follows b
    # e's chain ends at c, which can no longer feed anyone: e heads it, fed by the roots
    assert swarms.join("e", "dc1", 0b1111, lambda x: x in alive, chains=lambda: 2) == [(0b1111, None)]
