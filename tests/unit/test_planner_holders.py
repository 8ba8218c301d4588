"""The walk's shortcuts: what the holder index (``planner.HolderIndex``) may answer, and
that a walk narrowed by it, or a ``deferred`` answer cut short, plans exactly what the
full walk plans."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub_cli.planner import Asking, HolderIndex, Limits, Place, Reader, Sources, Walk, choose, join
from tensorhub_cli.planner.holders import BLOCK, BLOCK_COST

from .test_planner import Ep, Rep

CHUNKS = 12
NODES = [Place(f"n{dc}{rack}{node}", f"r{dc}{rack}", f"dc{dc}") for dc in range(2) for rack in range(2)
         for node in range(2)]


def test_relevant_names_exactly_the_holders_of_the_needed_chunks_in_the_dc():
    # A TP-like DC: 64 holders, 8 slices of a block and a half each (so slices share
    # blocks); a reader of slice 3 needs 4 of its chunks, which 8 holders hold: the
    # walk is narrowed to those 8, not to every holder of the chunks' blocks.
    width = BLOCK + BLOCK // 2
    index = HolderIndex()
    for i in range(64):
        index.add(f"h{i}", "dc0", (1 << width) - 1 << width * (i % 8))
    index.add("far", "dc1", (1 << 8 * width) - 1)  # another DC holds everything: not offered
    needed = 0b1111 << 3 * width + BLOCK // 2 - 2  # two chunks either side of a block's edge
    got = index.relevant("dc0", needed, walked=64)
    assert got == {f"h{i}" for i in range(64) if i % 8 == 3}
    assert index.relevant("dc0", 0, walked=64) == set()
    assert index.relevant("dc9", 0b1, walked=64) == set()


def test_relevant_gives_up_where_walking_is_cheaper():
    index = HolderIndex()
    for i in range(10):
        index.add(f"h{i}", "dc0", 0b11)  # every holder has both chunks
    assert index.relevant("dc0", 0b01, walked=10) is None  # the union would be every holder
    for i in range(10):
        index.add(f"x{i}", "dc0", 1 << BLOCK * (i + 1))  # one holder a chunk, a block each
    blocks = 20 // BLOCK_COST + 1
    needed = sum(1 << BLOCK * (i + 1) for i in range(blocks))
    assert index.relevant("dc0", needed, walked=20) is None  # visiting the blocks costs more than the walk
    assert index.relevant("dc0", needed, walked=blocks * BLOCK_COST) == {f"x{i}" for i in range(blocks)}


def test_a_report_costs_the_blocks_it_touches_not_its_chunks():
    # The hub indexes every report of every reader: a far slice of a big version is
    # a few blocks, however many chunks (``blocks`` steps once per block).
    from tensorhub_cli.planner.holders import blocks
    far = (1 << 3 * BLOCK) - 1 << 100_000 * BLOCK
    assert list(blocks(far)) == [100_000, 100_001, 100_002]
    assert list(blocks(1 | 1 << BLOCK - 1 | 1 << 5 * BLOCK)) == [0, 5]
    index = HolderIndex()
    index.add("a", "dc0", far)
    assert index.relevant("dc0", 1 << 100_001 * BLOCK + 7, walked=8) == {"a"}
    assert index.relevant("dc0", 1 << 100_003 * BLOCK, walked=8) == set()


def test_add_skips_what_is_indexed_and_drop_forgets_every_chunk():
    index = HolderIndex()
    index.add("a", "dc0", 0b011)
    index.add("a", "dc0", 0b111)  # the whole holding again, grown by chunk 2
    index.add("b", "dc0", 0b100 | 1 << BLOCK)
    assert [index.holders("dc0", c) for c in range(3)] == [{"a"}, {"a"}, {"a", "b"}]
    assert index.holders("dc0", BLOCK) == {"b"} and index.holders("dc0", BLOCK + 1) == set()
    index.drop("a")
    assert [index.holders("dc0", c) for c in range(3)] == [set(), set(), {"b"}]
    assert index.relevant("dc0", 0b011, walked=8) == set()
    index.drop("b")
    assert index.dcs() == []


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_relevant_is_none_or_exact(data):
    names = [f"h{i}" for i in range(data.draw(st.integers(1, 30)))]
    wide = 3 * BLOCK  # (over several blocks: the index keeps blocks, and answers chunks)
    held = {n: data.draw(st.integers(0, (1 << wide) - 1) | st.integers(0, 3 * BLOCK - 1).map(lambda c: 1 << c))
            for n in names}
    dc = {n: data.draw(st.sampled_from(["dc0", "dc1"])) for n in names}
    index = HolderIndex()
    for n in names:
        index.add(n, dc[n], held[n])
    for n in data.draw(st.lists(st.sampled_from(names), unique=True)):
        index.drop(n)
        held[n] = 0
    needed = data.draw(st.integers(0, (1 << wide) - 1) | st.integers(0, 3 * BLOCK - 1).map(lambda c: 1 << c))
    walked = data.draw(st.integers(1, 40))
    got = index.relevant("dc0", needed, walked)
    assert got is None or got == {n for n in names if dc[n] == "dc0" and held[n] & needed}


class Eager(HolderIndex):
    """Never gives up: every walk below is narrowed, whatever it costs."""

    __slots__ = ()

    def relevant(self, dc, needed, walked):
        return super().relevant(dc, needed, walked=1 << 30)


@st.composite
def cluster(draw):
    """A version's holders in 2 DCs × 2 racks × 2 nodes, with loads, drains, chunks in
    flight, dead holders and a publisher or two: what a walk reads."""
    n = draw(st.integers(2, 24))
    names = [f"e{i}" for i in range(n)]
    places = {name: draw(st.sampled_from(NODES)) for name in names}
    places["me"] = draw(st.sampled_from(NODES))
    full_mask = (1 << CHUNKS) - 1
    replicas = {}
    for i, name in enumerate(names):
        if draw(st.integers(0, 9)) == 0 or i == 0 and draw(st.booleans()):
            replicas[name] = Rep(full_mask, rank=0)  # a publisher (its shard: the whole version)
        else:
            replicas[name] = Rep(draw(st.integers(0, full_mask)))
    cap = 4
    load = {name: draw(st.integers(0, cap)) for name in names}
    serving = {}
    for name in names:
        chunks = draw(st.lists(st.integers(0, CHUNKS - 1), max_size=3, unique=True))
        chunks = [c for c in chunks if replicas[name].held >> c & 1]
        if chunks:
            serving[name] = {c: 1 for c in chunks}
    return dict(
        places=places, replicas=replicas, load={k: v for k, v in load.items() if v},
        full={k for k, v in load.items() if v >= cap}, serving=serving,
        draining=set(draw(st.lists(st.sampled_from(names), max_size=2))),
        dead=set(draw(st.lists(st.sampled_from(names), max_size=2))),
        needed=draw(st.integers(1, full_mask)), avoid=set(draw(st.lists(st.sampled_from(names), max_size=1))),
        mine=draw(st.dictionaries(st.sampled_from(names), st.integers(1, 2), max_size=2)),
        may_cross=draw(st.booleans()), limit=draw(st.integers(1, 8)), start=draw(st.integers(0, CHUNKS - 1)),
    )


class Lazy(HolderIndex):
    """Always gives up: every level walks its holders whole (the last level those of
    the other DCs, not every replica)."""

    __slots__ = ()

    def relevant(self, dc, needed, walked):
        return None


def plan(c, index_class=None, whole_deferred=False):
    near_holders, near_endpoints = {}, {}
    for name, place in c["places"].items():
        join(near_endpoints, place, name)
        if name in c["replicas"] and c["replicas"][name].held:  # as the hub indexes them (``publishing.index``)
            join(near_holders, place, name)
    endpoints = {n: Ep(pl, last_seen=-10.0 if n in c["dead"] else 0.0) for n, pl in c["places"].items()}
    sending = {s: sum(1 << ch for ch in chunks) for s, chunks in c["serving"].items()}
    publishers = {n for n, r in c["replicas"].items() if r.rank >= 0}
    holding = None
    if index_class is not None:
        holding = index_class()
        for name, rep in c["replicas"].items():
            holding.add(name, c["places"][name].dc, rep.held)
    sources = Sources(c["replicas"], publishers, c["draining"], endpoints, near_holders, near_endpoints, c["load"],
                      c["full"], c["serving"], {}, sending, holding)
    reader = Reader("me", c["places"]["me"], c["needed"], dict(c["mine"]), c["avoid"])
    walk = Walk(reader, sources, Limits(now=0.0, expiry_s=5.0, cap=4), Asking())
    deferred = (lambda want, enough=0: walk.deferred(want)) if whole_deferred else walk.deferred
    result = choose(needed=c["needed"], start=c["start"], limit=c["limit"], levels=walk.levels(c["may_cross"]),
                    may_cross=c["may_cross"], deferred=deferred)
    return result, walk


@settings(max_examples=500, deadline=None)
@given(cluster())
def test_a_walk_narrowed_by_the_index_plans_what_the_full_walk_plans(c):
    full, whole = plan(c)
    narrowed, walk = plan(c, Eager)
    assert walk._relevant is not None or not walk._asked  # narrowed wherever it asked the index
    assert narrowed.reads() == full.reads() and narrowed.waiting == full.waiting
    assert walk.busy_held == whole.busy_held


@settings(max_examples=500, deadline=None)
@given(cluster())
def test_a_walk_of_the_other_dcs_holders_plans_what_a_walk_of_every_replica_plans(c):
    # Replicas that hold nothing yet (a reader is one from its first plan) are in no
    # DC's holders: the last level leaves them out, index or not.
    full, whole = plan(c)
    walked, walk = plan(c, Lazy)
    assert walked.reads() == full.reads() and walked.waiting == full.waiting
    assert walk.busy_held == whole.busy_held


@settings(max_examples=500, deadline=None)
@given(cluster(), st.integers(0, (1 << CHUNKS) - 1))
def test_deferred_is_every_busy_and_capped_chunk_in_the_dc(c, want):
    # Full publishers are asked first (``Walk.deferred``); the answer is still the
    # chunks the walk found busy plus those of every capped source alive in the DC.
    _, walk = plan(c)
    dc = c["places"]["me"].dc
    capped = {n for n in c["full"] if n in c["replicas"] and c["replicas"][n].held and c["places"][n].dc == dc
              and n not in c["draining"] and n not in c["dead"]}
    expect = walk.busy_held
    for n in capped:
        expect |= c["replicas"][n].held & want
    assert walk.deferred(want) == expect


@settings(max_examples=500, deadline=None)
@given(cluster())
def test_a_deferred_answer_cut_short_plans_what_the_whole_answer_plans(c):
    whole, _ = plan(c, whole_deferred=True)
    short, _ = plan(c)
    assert short.reads() == whole.reads() and short.waiting == whole.waiting


def test_deferred_stops_at_the_busy_chunks_once_they_are_enough():
    # The relay is sending chunks 0 and 1 to others (busy); the capped source, at its
    # read cap, holds 2 and 3 (``full_held``).
    reps = {"relay": Rep(0b0011), "capped": Rep(0b1100)}
    places = {"me": NODES[0], "relay": NODES[2], "capped": NODES[3]}
    c = dict(places=places, replicas=reps, load={"relay": 2, "capped": 4}, full={"capped"},
             serving={"relay": {0: 1, 1: 1}}, draining=set(), dead=set(), needed=0b1111, avoid=set(), mine={},
             may_cross=True, limit=4, start=0)
    result, walk = plan(c)
    assert result.reads() == [] and walk.busy_held == 0b0011
    assert walk.deferred(0b1111, enough=2) == 0b0011  # two busy chunks are enough: the capped source is not asked
    assert walk.deferred(0b1111, enough=3) == 0b1111
    assert walk.deferred(0b1111) == 0b1111
