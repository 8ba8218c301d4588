"""The planner on plain data: no hub, no sockets. Each test pins one source-choice rule."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub_cli.planner import (REMOTE, Asking, Candidate, Limits, Place, PlanResult, Reader, Sources, Walk,
                                   choose, first_bit, full_held, groups, join, leave, level_between, may_cross,
                                   room, serving_mask, spread, copies, withheld)
from tensorhub_cli.planner.choose import _greedy

A = Place("n1", "r1", "dc1")
SAME_RACK = Place("n2", "r1", "dc1")
SAME_DC = Place("n3", "r2", "dc1")
OTHER_DC = Place("n4", "r9", "dc2")


@dataclass
class Rep:
    held: int
    rank: int = -1


@dataclass
class Ep:
    place: Place
    last_seen: float = 0.0


def levels(*groups_):
    return list(enumerate(groups_))


# --- topology ---------------------------------------------------------------------

def test_levels_follow_the_narrowest_shared_group():
    assert [level_between(A, b) for b in (A, SAME_RACK, SAME_DC, OTHER_DC)] == [0, 1, 2, REMOTE]
    # a rack name reused in another DC is another rack
    assert level_between(A, Place("n9", "r1", "dc2")) == REMOTE


def test_join_and_leave_keep_the_index_exact():
    index: dict = {}
    join(index, A, "a")
    join(index, SAME_RACK, "b")
    assert index[("rack", "dc1", "r1")] == {"a", "b"}
    leave(index, A, "a")
    leave(index, SAME_RACK, "b")
    assert index == {}  # empty groups are dropped, not left as empty sets
    assert len(groups(A)) == 3


# --- choose -----------------------------------------------------------------------

def test_cheapest_level_serves_first_and_dearer_levels_are_not_built():
    built = []

    def lazy():
        for n, cands in enumerate([[Candidate("near", 0b1111, 0, 0)], [Candidate("far", 0b1111, 1, 0)]]):
            built.append(n)
            yield n, cands

    result = choose(needed=0b1111, start=0, limit=4, levels=lazy(), may_cross=True)
    assert {s for _, s, _ in result.reads()} == {"near"}
    assert built == [0]  # level 1 was never asked for


def test_rarest_chunk_first_and_relays_before_publishers_at_equal_cost():
    a = Candidate("a", 0b11, 2, 0)
    b = Candidate("b", 0b01, 2, 5)
    result = choose(needed=0b11, start=0, limit=1, levels=levels([a, b]), may_cross=True)
    assert result.reads() == [(1, "a", 2)]  # chunk 1: only a has it, though start points at 0
    pub = Candidate("pub", 0b11, 2, 0, publisher=True)
    relay = Candidate("relay", 0b11, 2, 3)
    result = choose(needed=0b11, start=0, limit=1, levels=levels([pub, relay]), may_cross=True)
    assert result.reads() == [(0, "relay", 2)]  # the trainer is not the one feeding every reader


def test_room_caps_a_source_and_load_spreads_the_rest():
    a = Candidate("a", 0b1111, 1, 0, room=1)
    b = Candidate("b", 0b1111, 1, 0)
    result = choose(needed=0b1111, start=0, limit=4, levels=levels([a, b]), may_cross=True)
    by_source = {}
    for _, s, _ in result.reads():
        by_source[s] = by_source.get(s, 0) + 1
    assert by_source == {"a": 1, "b": 3}


def test_a_reader_that_may_not_cross_waits_for_chunks_only_another_dc_has():
    local = Candidate("local", 0b0011, 2, 0)
    remote = Candidate("remote", 0b1111, REMOTE, 0)
    result = choose(needed=0b1111, start=0, limit=4, levels=[(2, [local]), (REMOTE, [remote])], may_cross=False)
    assert {s for _, s, _ in result.reads()} == {"local"}
    crossing = choose(needed=0b1111, start=0, limit=4, levels=[(2, [local]), (REMOTE, [remote])], may_cross=True)
    assert crossing.crossed and {s for _, s, _ in crossing.reads()} == {"local", "remote"}


def test_deferred_chunks_never_cross_a_dc_link():
    remote = Candidate("remote", 0b1111, REMOTE, 0)
    result = choose(needed=0b1111, start=0, limit=4, levels=[(2, []), (REMOTE, [remote])], may_cross=True,
                    deferred=lambda want, enough=0: want & 0b0011)  # busy in-DC holders have chunks 0 and 1
    assert sorted(c for c, _, _ in result.reads()) == [2, 3]


def test_suspects_serve_only_when_nothing_else_holds_the_chunk():
    bad = Candidate("bad", 0b11, 0, 0, suspect=True)
    good = Candidate("good", 0b01, 2, 9)
    result = choose(needed=0b11, start=0, limit=2, levels=levels([bad], [], [good]), may_cross=True)
    assert sorted(result.reads()) == [(0, "good", 2), (1, "bad", 0)]


def test_waiting_counts_chunks_no_allowed_source_holds():
    result = choose(needed=0b111, start=0, limit=3, levels=levels([Candidate("a", 0b001, 0, 0)]), may_cross=True)
    assert result.waiting == 2


def test_first_bit_wraps_around_from_start():
    assert first_bit(0b10010, 2) == 4
    assert first_bit(0b00010, 2) == 1
    assert first_bit(0, 3) == -1


# --- rules ------------------------------------------------------------------------

def test_one_seed_per_dc_crosses_and_an_inactive_seed_hands_the_role_on():
    assert may_cross(None, "r1", seed_active=False)
    assert may_cross("r1", "r1", seed_active=True)
    assert not may_cross("r1", "r2", seed_active=True)
    assert may_cross("r1", "r2", seed_active=False)


def test_spread_counts_readers_not_publishers_nor_draining_ones():
    reps = {"pub": Rep(0b0001, rank=0), "r1": Rep(0b0010), "r2": Rep(0b0100), "gone": Rep(0b1000)}
    assert spread({"pub", "r1", "r2", "gone", "unknown"}, reps, draining={"r2"}) == 0b1010


def test_copies_counts_chunks_two_readers_hold():
    reps = {"pub": Rep(0b1111, rank=0), "r1": Rep(0b0011), "r2": Rep(0b0110), "r3": Rep(0b0100), "gone": Rep(0b1000)}
    assert copies({"pub", "r1", "r2", "r3", "gone"}, reps, draining={"gone"}) == (0b0111, 0b0110)


def test_withheld_is_every_relayed_chunk_until_nothing_fresh_is_left():
    once, twice = 0b0111, 0b0110
    assert withheld(0b1111, once, twice, sending=0) == once  # chunk 3 is fresh
    assert withheld(0b1111, once, twice, sending=0b1000) == twice  # chunk 3 is on its way: the tail
    assert withheld(0b0111, once, twice, sending=0) == twice  # (a publisher of part of the version)


def test_full_held_skips_closed_and_dead_sources():
    reps = {"a": Rep(0b0011), "b": Rep(0b0100), "c": Rep(0b1000)}
    alive = {"a": True, "b": True, "c": False}.get
    assert full_held({"a", "b", "c"}, reps, want=0b1111, closed={"b"}, alive=alive) == 0b0011


def test_serving_mask():
    assert serving_mask({0: 1, 3: 2}) == 0b1001
    assert serving_mask(None) == 0


# --- fairness ---------------------------------------------------------------------

def test_a_lone_reader_is_uncapped_and_askers_split_the_slots():
    assert room(cap=4, busy=0, mine=0, others=0) > 1000
    assert room(cap=4, busy=3, mine=3, others=0) > 1000  # only its own reads in flight
    assert room(cap=4, busy=2, mine=2, others=1) == 0  # two askers: 2 each, it has its 2
    assert room(cap=4, busy=1, mine=0, others=1) == 2
    assert room(cap=4, busy=4, mine=0, others=7) == 0  # the source is at its cap
    assert room(cap=4, busy=0, mine=0, others=7) == 1  # never less than one slot each


def test_asking_forgets_stale_and_finished_readers():
    asking = Asking(window_s=0.25)
    asking.note("pub", "r1", now=0.0)
    asking.note("pub", "r2", now=0.0)
    assert asking.others("pub", "r1", now=0.1) == 1
    asking.done("r2")
    assert asking.others("pub", "r1", now=0.1) == 0
    asking.note("pub", "r3", now=0.1)
    assert asking.others("pub", "r1", now=1.0) == 0  # r3 is stale past the window
    asking.note("pub", "r4", now=1.0)
    asking.forget("pub")
    assert asking.others("pub", "r1", now=1.0) == 0


# --- the walk ---------------------------------------------------------------------

def sources(replicas, places, *, draining=(), load=None, full=None, serving=None, publishers=None):
    near_holders: dict = {}
    near_endpoints: dict = {}
    for name, place in places.items():
        join(near_endpoints, place, name)
        if name in replicas:
            join(near_holders, place, name)
    endpoints = {n: Ep(pl) for n, pl in places.items()}
    pubs = publishers if publishers is not None else {n for n, r in replicas.items() if r.rank >= 0}
    return Sources(replicas, pubs, set(draining), endpoints, near_holders, near_endpoints, load or {},
                   set(full or ()), serving or {}, {})


def walk(sources_, needed, *, star=False, now=0.0, retention_pull=False, avoid=()):
    reader = Reader("me", A, needed, {}, avoid, retention_pull)
    return Walk(reader, sources_, Limits(now=now, expiry_s=5.0, cap=4, star=star), Asking())


def offered(w: Walk, may_cross=True):
    return {c.name: (c.level, c.held) for _, cands in w.levels(may_cross) for c in cands}


def test_walk_offers_holders_at_their_level_and_skips_dead_and_draining():
    reps = {"a": Rep(0b1), "b": Rep(0b1), "c": Rep(0b1), "d": Rep(0b1), "e": Rep(0b1)}
    s = sources(reps, {"me": A, "a": A, "b": SAME_RACK, "c": SAME_DC, "d": OTHER_DC, "e": SAME_RACK},
                draining={"e"})
    assert offered(walk(s, 0b1)) == {"a": (0, 1), "b": (1, 1), "c": (2, 1), "d": (3, 1)}
    s.endpoints["a"].last_seen = -10.0  # past expiry
    assert "a" not in offered(walk(s, 0b1))
    assert "d" not in offered(walk(s, 0b1), may_cross=False)
    assert "e" in offered(walk(s, 0b1, retention_pull=True))  # its own retention copy may read it


def test_walk_publisher_withholds_chunks_readers_in_the_dc_hold():
    reps = {"pub": Rep(0b1111, rank=0), "relay": Rep(0b0011)}
    s = sources(reps, {"me": A, "pub": SAME_DC, "relay": SAME_DC})
    w = walk(s, 0b1111)
    got = offered(w)
    assert got["pub"] == (2, 0b1100) and got["relay"] == (2, 0b0011)
    assert w.busy_held == 0b0011
    # a reader that met a bad holder may read anything from the publisher again
    assert offered(walk(s, 0b1111, avoid={"relay"}))["pub"] == (2, 0b1111)


def test_walk_skips_full_sources_and_defers_their_chunks():
    reps = {"busy": Rep(0b0011), "free": Rep(0b1100)}
    s = sources(reps, {"me": A, "busy": SAME_RACK, "free": SAME_DC}, full={"busy"}, load={"busy": 4})
    w = walk(s, 0b1111)
    assert set(offered(w)) == {"free"}
    assert w.deferred(0b1111) == 0b0011


def test_walk_routes_chunks_in_flight_to_the_reader_receiving_them():
    reps = {"src": Rep(0b0111)}
    s = sources(reps, {"me": A, "src": SAME_RACK}, serving={"src": {0: 1}})
    w = walk(s, 0b0111)
    assert offered(w)["src"] == (1, 0b0110)
    assert w.busy_held & 0b0001


def test_walk_fair_share_turns_a_reader_away_from_a_crowded_publisher():
    reps = {"pub": Rep(0b1111, rank=0)}
    s = sources(reps, {"me": A, "pub": SAME_RACK}, load={"pub": 3})
    w = walk(s, 0b1111)
    w.reader.mine["pub"] = 1
    for other in ("x", "y", "z", "q"):
        w.asking.note("pub", other, 0.0)
    assert offered(w) == {}  # five askers: one slot each, and this reader has its one
    assert w.busy_held == 0b1111


def test_walk_star_offers_only_publishers_with_their_true_level():
    reps = {"pub": Rep(0b11, rank=0), "relay": Rep(0b11)}
    s = sources(reps, {"me": A, "pub": OTHER_DC, "relay": A})
    assert offered(walk(s, 0b11, star=True)) == {"pub": (REMOTE, 0b11)}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), min_size=1, max_size=6),
       st.data())
def test_disjoint_holders_get_their_chunks_at_once_as_the_greedy_would_give_them(specs, data):
    # A schedule's roots, most often: publishers whose shards do not overlap. ``choose``
    # assigns each its chunks a source at a time (``fed``); the greedy, chunk by chunk,
    # gives the same chunks to the same sources.
    chunks = list(range(24))
    owner = {c: data.draw(st.integers(-1, len(specs) - 1)) for c in chunks}  # -1: nobody holds it
    cands = []
    for i, (level, load, publisher) in enumerate(specs):
        held = sum(1 << c for c in chunks if owner[c] == i)
        cands.append(Candidate(f"s{i}", held, level, load, publisher=publisher))
    needed = data.draw(st.integers(1, (1 << 24) - 1))
    start = data.draw(st.integers(0, 23))
    fast = choose(needed=needed, start=start, limit=needed.bit_count(), levels=[(0, cands)], may_cross=True)
    assert not fast.assigned  # (the fast path ran)
    slow = PlanResult()
    ranked = [Candidate(c.name, c.held, c.level, c.load, publisher=c.publisher) for c in cands]
    _greedy(slow, ranked, needed, 0, start, needed.bit_count())
    assert fast.reads() == slow.reads()
    assert fast.waiting == (needed & ~sum(c.held for c in cands)).bit_count()
