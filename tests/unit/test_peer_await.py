"""Holder notices on the peer channel (``wire.Await`` / ``wire.await_chunks``): a reader
waiting for chunks its source does not hold yet is answered when the source marks one
held (``Replica.mark_held``, from any thread), at once when it already holds one, with an
empty mask at the timeout, and refused for a version the holder does not hold, once the
replica is dropped, and for a bad token. Real sockets, a real ``PeerServer``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorhub_cli.endpoint.peer import PeerServer
from tensorhub_cli.endpoint.replica import Replica
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.layout import lay_out, place

TOKEN = "t" * 16


def replica(rank: int = -1, world: int = 1) -> Replica:
    sd = {f"w{i}": torch.full((1024,), float(i)) for i in range(6)}  # 4 KiB each: one chunk each
    manifest, _ = lay_out(sd, 4096, 0)
    placed = place([manifest], {k: torch.zeros_like(v) for k, v in sd.items()})
    return Replica(model="m", version=1, world=world, shards=[manifest], rank=rank, placed=placed, handle=None)


@pytest.fixture
def rig():
    """(server, replicas): ``replicas`` is what the server's ``replica`` looks up."""
    replicas: dict = {}
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), Regions(),
                        replica=replicas.get)
    yield server, replicas
    server.close(timeout=5)


def waiting(fn, *args, **kw):
    """Run ``fn`` on a thread; (thread, outcome dict with 'value' or 'error', 'at')."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except Exception as exc:
            out["error"] = exc
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def wait_subscribed(held: Replica, n: int = 1, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while len(held.waiters) < n:
        assert time.monotonic() < deadline, "the await never reached the holder's replica"
        time.sleep(0.005)


def test_a_waiter_is_answered_when_another_thread_marks_an_asked_chunk_held(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    t, out = waiting(wire.await_chunks, server.address, TOKEN, "m", 1, 0b1100, 20.0)
    wait_subscribed(held)
    held.mark_held([0])  # not asked: the waiter sleeps on
    time.sleep(0.05)
    assert "at" not in out, f"answered for a chunk it did not ask for: {out}"
    marked = time.monotonic()
    threading.Thread(target=held.mark_held, args=([3, 5],)).start()
    t.join(timeout=10)
    assert not t.is_alive(), "the waiter was not answered after its chunk was marked held"
    assert out.get("value") == 0b1000, out
    assert out["at"] - marked < 1.0, "answered only at the timeout, not by the mark"
    assert not held.waiters, "an answered wait stayed subscribed"


def test_a_waiter_is_answered_at_once_with_every_asked_chunk_already_held(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    held.mark_held([1, 2, 4])
    t0 = time.monotonic()
    assert wire.await_chunks(server.address, TOKEN, "m", 1, 0b10110 | 1, 20.0) == 0b10110
    assert time.monotonic() - t0 < 5.0, "waited although chunks were held"


def test_a_publisher_answers_with_its_whole_shard(rig):
    server, replicas = rig
    replicas[("m", 1)] = replica(rank=0, world=1)
    assert wire.await_chunks(server.address, TOKEN, "m", 1, 0b100001, 20.0) == 0b100001
    replicas[("m", 1)] = replica(rank=1, world=2)  # (where its shard starts is not its to know)
    assert wire.await_chunks(server.address, TOKEN, "m", 1, 1 << 40, 20.0) == 1 << 40


def test_nothing_held_within_the_timeout_is_an_empty_answer(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    assert wire.await_chunks(server.address, TOKEN, "m", 1, 0b11, 0.2) == 0
    assert not held.waiters, "a timed-out wait stayed subscribed"


def test_the_holder_caps_the_wait():
    replicas: dict = {("m", 1): replica()}
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), Regions(),
                        replica=replicas.get, await_cap_s=0.2)
    try:
        t, out = waiting(wire.await_chunks, server.address, TOKEN, "m", 1, 0b1, 60.0)
        t.join(timeout=10)
        assert out.get("value") == 0, out
    finally:
        server.close(timeout=5)


def test_a_wait_is_refused_when_the_replica_is_dropped(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    t, out = waiting(wire.await_chunks, server.address, TOKEN, "m", 1, 0b1, 20.0)
    wait_subscribed(held)
    del replicas[("m", 1)]  # what ``Replicas.drop`` does
    held.gone()
    t.join(timeout=10)
    assert not t.is_alive(), "a wait outlived its replica"
    assert isinstance(out.get("error"), wire.PeerError) and "not_found" in str(out["error"]), out
    assert "dropped" in str(out["error"])
    replicas[("m", 1)] = held  # (looked up before the drop, subscribed after it)
    with pytest.raises(wire.PeerError, match="dropped"):
        wire.await_chunks(server.address, TOKEN, "m", 1, 0b1, 20.0)


def test_an_unknown_version_is_refused_naming_it(rig):
    server, replicas = rig
    replicas[("m", 1)] = replica()
    with pytest.raises(wire.PeerError, match=r"not_found.*m@2"):
        wire.await_chunks(server.address, TOKEN, "m", 2, 0b1, 20.0)


def test_a_bad_token_is_refused(rig):
    server, replicas = rig
    replicas[("m", 1)] = replica()
    with pytest.raises(wire.PeerError, match="auth"):
        wire.await_chunks(server.address, "x" * 16, "m", 1, 0b1, 20.0)


def test_bad_asks_are_refused_naming_the_field(rig):
    server, replicas = rig
    replicas[("m", 1)] = replica()  # 6 chunks
    with pytest.raises(wire.PeerError, match="chunk 6, past the version's 6 chunks"):
        wire.await_chunks(server.address, TOKEN, "m", 1, 1 << 6, 20.0)
    with pytest.raises(ValueError, match="mask"):
        wire.await_chunks(server.address, TOKEN, "m", 1, 0, 20.0)
    with pytest.raises(ValueError, match="timeout"):
        wire.await_chunks(server.address, TOKEN, "m", 1, 1, float("nan"))
    for chunks, timeout_s, field in [(b"", 1.0, "chunks"), (b"\x01", -1.0, "timeout_s"),
                                     (b"\x01", float("inf"), "timeout_s")]:
        ask = wire.Await(model="m", version=1, chunks=chunks, timeout_s=timeout_s)
        with wire.dial(server.address, 10) as sock:
            sock.sendall(wire.frame(wire.Ask(v=wire.WIRE_VERSION, token=TOKEN, op=ask)))
            body = wire.recv_answer(sock).body
        assert isinstance(body, wire.Refused) and body.code == "bad_request" and field in body.message, body


def test_an_answered_connection_serves_the_next_ask(rig):
    server, replicas = rig
    replicas[("m", 1)] = held = replica()
    held.mark_held([2])
    with wire.dial(server.address, 10) as sock:
        for _ in range(2):
            ask = wire.Await(model="m", version=1, chunks=wire.mask_bytes(0b100), timeout_s=5.0)
            sock.sendall(wire.frame(wire.Ask(v=wire.WIRE_VERSION, token=TOKEN, op=ask)))
            assert wire.recv_answer(sock).body == wire.Have(chunks=b"\x04")


def test_an_endpoint_dropping_its_replica_refuses_the_waits_for_it():
    """``Replicas.drop`` (unpublish, release, a failed fetch) answers its waits."""
    from .test_registration_cache import CountingEngine, Hub, bare_endpoint

    ep = bare_endpoint(CountingEngine(), Hub([]))
    held = replica()
    ep.replicas.add(held)
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), ep.served,
                        replica=ep.replicas.get)  # (as ``Endpoint.__init__`` builds it)
    try:
        t, out = waiting(wire.await_chunks, server.address, TOKEN, "m", 1, 0b1, 20.0)
        wait_subscribed(held)
        ep.replicas.drop(held)
        t.join(timeout=10)
        assert "dropped" in str(out.get("error")), out
    finally:
        server.close(timeout=5)


def test_a_holder_that_predates_await_refuses_it_and_the_reader_hears_a_peer_error(rig, monkeypatch):
    import msgspec

    class OldAsk(msgspec.Struct):  # the Ask of a holder from before Await
        v: int
        token: str
        op: wire.Describe | wire.ReadRanges | wire.ReadBytes

    monkeypatch.setattr(wire, "decode_ask", msgspec.msgpack.Decoder(OldAsk).decode)
    server, replicas = rig
    replicas[("m", 1)] = replica()
    with pytest.raises(wire.PeerError, match="malformed"):
        wire.await_chunks(server.address, TOKEN, "m", 1, 0b1, 20.0)


# --- fragments (``Await.after``, ``Replica.mark_landed``) ------------------------------------
def test_a_fragments_waiter_is_answered_when_the_holder_lands_more_of_an_asked_chunk(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    held.mark_landed(3, 1024)  # known to the asker already: no answer for it
    t, out = waiting(wire.await_fragments, server.address, TOKEN, "m", 1, 0b1100, 20.0, None, {3: 1024})
    wait_subscribed(held)
    held.mark_landed(5, 512)  # not asked
    time.sleep(0.1)
    assert t.is_alive(), f"answered for bytes it knew or did not ask: {out}"
    threading.Thread(target=held.mark_landed, args=(2, 2048)).start()
    t.join(timeout=10)
    assert out.get("value") == (0, {2: 2048, 3: 1024}), out


def test_a_plain_waiter_never_hears_of_unverified_bytes(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    t, out = waiting(wire.await_chunks, server.address, TOKEN, "m", 1, 0b1, 20.0)
    wait_subscribed(held)
    held.mark_landed(0, 4096)
    time.sleep(0.1)
    assert t.is_alive(), f"a wait without after answered for landed bytes: {out}"
    held.mark_held([0])
    t.join(timeout=10)
    assert out.get("value") == 1, out


def test_held_supersedes_landed_and_a_restart_forgets_the_bytes(rig):
    server, replicas = rig
    held = replicas[("m", 1)] = replica()
    held.mark_landed(1, 1024)
    held.mark_landed(1, 0)  # its read failed: those bytes may be rewritten
    assert wire.await_fragments(server.address, TOKEN, "m", 1, 0b10, 0.2, None, {1: 0}) == (0, {})
    held.mark_landed(1, 2048)
    held.mark_held([1])
    held.mark_landed(1, 1024)  # (a late fragment of a chunk held: ignored)
    assert wire.await_fragments(server.address, TOKEN, "m", 1, 0b11, 5.0, None, {0: 0, 1: 0}) == (0b10, {})


def test_an_after_naming_a_chunk_not_asked_is_refused_naming_it(rig):
    server, replicas = rig
    replicas[("m", 1)] = replica()
    with pytest.raises(wire.PeerError, match="after names a chunk not in chunks"):
        wire.await_fragments(server.address, TOKEN, "m", 1, 0b1, 5.0, None, {2: 0})


def test_a_kept_connection_carries_one_await_after_another(rig):
    """A reader's notices from one source ride one connection (``wire.Kept``), however
    many waits it carries, refusals that leave the connection open included."""
    server, replicas = rig
    replicas[("m", 1)] = replica()
    replicas[("m", 1)].mark_held([0, 2])
    kept = wire.Kept(server.address)
    try:
        ends = set()
        for mask, want in [(0b1, 0b1), (0b100, 0b100), (0b101, 0b101)]:
            assert wire.await_chunks(server.address, TOKEN, "m", 1, mask, 5.0, kept=kept) == want
            ends.add(kept._sock.getsockname())
        with pytest.raises(wire.PeerError, match="not_found"):
            wire.await_chunks(server.address, TOKEN, "m", 9, 0b1, 5.0, kept=kept)
        assert wire.await_chunks(server.address, TOKEN, "m", 1, 0b10, 0.1, kept=kept) == 0
        ends.add(kept._sock.getsockname())
        assert len(ends) == 1, f"{len(ends)} connections for one kept one: {ends}"
    finally:
        kept.close()


def test_a_kept_connection_the_holder_closed_while_idle_is_dialed_again():
    replicas: dict = {("m", 1): replica()}
    replicas[("m", 1)].mark_held([1])
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), Regions(),
                        replica=replicas.get, idle_s=0.1)
    kept = wire.Kept(server.address)
    try:
        assert wire.await_chunks(server.address, TOKEN, "m", 1, 0b10, 5.0, kept=kept) == 0b10
        time.sleep(0.5)  # the holder drops the idle connection
        assert wire.await_chunks(server.address, TOKEN, "m", 1, 0b10, 5.0, kept=kept) == 0b10
    finally:
        kept.close()
        server.close(timeout=5)


def test_a_silent_holder_on_a_kept_connection_is_not_asked_twice(monkeypatch):
    """A timeout is an answer (the holder is stuck), not a stale connection: the kept
    connection that carried a wait before is not dialed again for it."""
    import socket

    monkeypatch.setattr(wire, "AWAIT_MARGIN_S", 0.2)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    kept = wire.Kept(address)
    conns = []
    try:
        t, out = waiting(wire.await_chunks, address, TOKEN, "m", 1, 0b1, 0.1, kept=kept)
        conns.append(listener.accept()[0])
        conns[0].recv(1 << 16)  # (the ask: small, one segment on loopback)
        conns[0].sendall(wire.frame(wire.Answer(body=wire.Have(chunks=wire.mask_bytes(0b1)))))
        t.join(timeout=10)
        assert out.get("value") == 0b1, out
        t, out = waiting(wire.await_chunks, address, TOKEN, "m", 1, 0b1, 0.1, kept=kept)
        t.join(timeout=10)  # asked on the kept connection, never answered
        assert isinstance(out.get("error"), wire.PeerError) and "did not answer" in str(out["error"]), out
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            conns.append(listener.accept()[0])
    finally:
        kept.close()
        for c in conns:
            c.close()
        listener.close()


def test_kept_by_holder_hands_each_holder_its_connection_and_closes_what_comes_back_late():
    pool = wire.KeptByHolder()
    a = pool.take("h1", "10.0.0.1:1")
    pool.put("h1", a)
    assert pool.take("h1", "10.0.0.1:1") is a, "a kept connection was not handed out again"
    pool.put("h1", a)
    b = pool.take("h1", "10.0.0.2:1")  # (the holder registered again elsewhere)
    assert b is not a and b.address == "10.0.0.2:1"
    closed = []
    b.close = lambda: closed.append(b)
    pool.close()
    pool.put("h1", b)  # (a wait that was out when the fetch ended)
    assert closed == [b], "a connection put back after close stayed open"
    assert pool.take("h1", "10.0.0.2:1") is not b


def test_closing_the_pool_calls_off_a_wait_out_on_a_silent_holder():
    """A fetch that ends with a wait out on a holder gone silent (its link down, its
    process stopped) does not leave that wait holding a thread until the ask's timeout:
    ``KeptByHolder.close`` ends it, and a wait taken after the close never dials."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    pool = wire.KeptByHolder()
    conns = []
    try:
        kept = pool.take("h1", address)
        t, out = waiting(wire.await_chunks, address, TOKEN, "m", 1, 0b1, 20.0, kept=kept)
        conns.append(listener.accept()[0])
        conns[0].recv(1 << 16)  # (the ask arrived; it is never answered)
        t.join(timeout=0.3)
        assert t.is_alive(), f"the wait ended before the pool closed: {out}"
        closed = time.monotonic()
        pool.close()
        t.join(timeout=5)
        assert not t.is_alive() and out["at"] - closed < 2.0, "the wait outlived the pool's close"
        assert isinstance(out.get("error"), wire.PeerError) and "called off" in str(out["error"]), out
        late = pool.take("h1", address)
        with pytest.raises(wire.PeerError, match="called off"):
            wire.await_chunks(address, TOKEN, "m", 1, 0b1, 20.0, kept=late)
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            conns.append(listener.accept()[0])  # (a wait after the close never dialed)
    finally:
        for c in conns:
            c.close()
        listener.close()


def test_every_authenticated_ask_calls_on_ask_and_a_refused_token_does_not():
    """``on_ask`` is how a holder's engine is paced hot the moment a reader arrives."""
    asks: list[float] = []
    replicas = {("m", 1): replica()}
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), Regions(),
                        replica=replicas.get, on_ask=lambda: asks.append(time.monotonic()))
    try:
        with pytest.raises(wire.PeerError, match="auth"):
            wire.await_chunks(server.address, "x" * 16, "m", 1, 0b1, 20.0)
        assert asks == []
        wire.await_chunks(server.address, TOKEN, "m", 1, 0b1, 0.1)  # (nothing held: empty at the timeout)
        assert len(asks) == 1 and asks[0] >= server.last_ask  # (called after it is set)
    finally:
        server.close(timeout=5)
