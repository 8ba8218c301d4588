"""Contract 3 under faults, on the hub: a slow heartbeat never releases a pin, a
replaced process is fenced, and an operator can read every event (issue: faults)."""

from __future__ import annotations

import sys
import threading
import time

import msgspec
import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.machine import Acked, HubFault
from tensorhub_cli.hub.service import HubService
from tensorhub_cli.hub.metrics import HubCollector

from .hubkit import acks, fetch_all, info, manifest, new_hub, reg


def publish_and_read(hub):
    """t publishes 4 chunks; r has a read in flight on t; t unpublishes (pending)."""
    reg(hub, 0, info("t", pid=10), info("r", node="n2", pid=20))
    for i in (hub.endpoints["t"].info, hub.endpoints["r"].info):
        i.incarnation = f"{i.name}-1"
    hub.publish(0, p.Publish(name="t", model="m", version=1, manifest=manifest(4)))
    plan = hub.plan(0, p.Plan(name="r", model="m", version=1, window=1))
    assert len(plan.reads) == 1
    assert hub.unpublish(0, p.Unpublish(name="t", model="m", version=1)) is None
    assert acks(hub.take_outbound()) == []
    return plan.reads[0]


def test_same_incarnation_reregistering_keeps_pins_and_pending_unpublish():
    hub = new_hub()
    read = publish_and_read(hub)
    # t's heartbeat reply was slow: it registers again, same process, same incarnation
    again = info("t", pid=10)
    again.incarnation = "t-1"
    hub.register(1.0, p.Register(info=again))
    assert acks(hub.take_outbound()) == []  # not answered "expired"
    assert hub.models["m"][1].pins == {"t": 1}
    hub.progress(1.0, p.Progress(name="r", model="m", version=1, chunks=[read.chunk]))
    assert acks(hub.take_outbound()) == [Acked(endpoint="t", model="m", version=1, ok=True)]
    assert hub.counters["registrations.kept"] == 1


def test_a_replaced_process_is_fenced_and_cannot_complete_its_old_reads():
    hub = new_hub()
    read = publish_and_read(hub)
    # r dies; a new process takes the name once the old one expired
    hub.heartbeat(4.0, p.Heartbeat(name="t"))
    assert hub.expire(7.0) == ["r"]
    new_r = info("r", node="n2", pid=21)
    new_r.incarnation = "r-2"
    hub.register(7.0, p.Register(info=new_r))
    before = msgspec.msgpack.encode(hub.versions(7.0, p.Versions()))
    for op in (p.Progress(name="r", model="m", version=1, chunks=[read.chunk], incarnation="r-1"),
               p.Plan(name="r", model="m", version=1, incarnation="r-1"),
               p.Cancel(name="r", model="m", version=1, incarnation="r-1")):
        with pytest.raises(HubFault) as exc:
            getattr(hub, type(op).__name__.lower())(7.0, op)
        assert exc.value.code == "fenced"
    with pytest.raises(HubFault, match="replaced"):
        hub.heartbeat(7.0, p.Heartbeat(name="r", incarnation="r-1"))
    assert msgspec.msgpack.encode(hub.versions(7.0, p.Versions())) == before
    hub.heartbeat(7.0, p.Heartbeat(name="r", incarnation="r-2"))  # the new one is fine


def test_events_since_a_seq_and_the_bound_is_reported():
    hub = new_hub()
    reg(hub, 0, info("a"))
    for i in range(600):
        hub.note(float(i), p.Note(kind="scaled", message=str(i)))
    got = hub.events_since(0, p.Events(since=590))
    assert [e.message for e in got.events] == [str(i) for i in range(590, 600)]
    everything = hub.events_since(0, p.Events())
    assert len(everything.events) == 500 and everything.first_seq == 101  # 100 were dropped


def test_metrics_scrapes_while_the_loop_changes_the_hub(tmp_path):
    """C4: Prometheus' thread read the hub's dicts while ops changed them."""
    hub = new_hub()
    service = HubService(hub, "tok", "tcp://127.0.0.1:*", clock=lambda: 0.0)
    try:
        reg(hub, 0, *[info(f"e{i}", node=f"n{i}") for i in range(300)])
        hub.publish(0, p.Publish(name="e0", model="m", version=1, manifest=manifest(8)))
        errors: list[BaseException] = []
        stop = threading.Event()

        def scrape():
            collector = HubCollector(service.status)
            while not stop.is_set():
                try:
                    list(collector.collect())
                except BaseException as exc:  # noqa: BLE001 - the failure under test
                    errors.append(exc)
                    return

        # Switch threads every microsecond, not every 5 ms, so a scrape is interrupted
        # mid-iteration as a loaded hub's would be.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        t = threading.Thread(target=scrape)
        t.start()
        deadline = time.monotonic() + 3.0
        n = 0
        while time.monotonic() < deadline and not errors:
            name = f"x{n % 200}"
            # each reader adds a replica to the version and drops it again
            for op in (p.Register(info=info(name, node=f"m{n}", pid=n)),
                       p.Plan(name=name, model="m", version=1, window=1), p.Deregister(name=name)):
                frame = p.encode(p.Request(v=p.PROTOCOL_VERSION, token="tok", rid=1, op=op))
                service.handle(b"id", [frame])
            n += 1
        stop.set()
        t.join(timeout=10)
        sys.setswitchinterval(interval)
        assert errors == [] and n > 100
    finally:
        service._sock.close(0)
        service._ctx.term()


def test_a_large_moe_manifest_fits_a_frame():
    """C11: a reader of a ~91k-tensor model re-registers after a hub restart with every
    shard's manifest; at an 8 MiB frame limit it never could."""
    n = 91_000
    tensors = [p.TensorMeta(name=f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w", dtype="bfloat16",
                            shape=[4096, 1024], nbytes=8 << 20, offset=i * (8 << 20)) for i in range(n)]
    chunks = [p.ChunkMeta(nbytes=16 << 20, checksum=(i * 2654435761) % (1 << 64)) for i in range(n // 2)]
    m = p.Manifest(tensors=tensors, chunks=chunks, chunk_bytes=16 << 20)
    holding = p.Holding(model="moe", version=1, world=1, shards=[m], held=list(range(n // 2)))
    frame = p.encode(p.Request(v=p.PROTOCOL_VERSION, token="tok", rid=1,
                               op=p.Register(info=info("r", node="n2"), holdings=[holding])))
    assert len(frame) > 8 << 20
    hub = new_hub()
    service = HubService(hub, "tok", "tcp://127.0.0.1:*", clock=lambda: 0.0)
    try:
        [(_, reply)] = service.handle(b"id", [frame])
        assert isinstance(p.decode_reply(reply).body, p.Ok)
        assert "r" in hub.endpoints and hub.models["moe"][1].complete("r")
    finally:
        service._sock.close(0)
        service._ctx.term()


def test_a_refused_duplicate_does_not_take_the_push_route():
    """C5, hub half: a Register refused ``conflict`` left its socket as the live
    endpoint's push route, so retention and sync commands went to the impostor."""
    hub = new_hub()
    service = HubService(hub, "tok", "tcp://127.0.0.1:*", clock=lambda: 0.0)
    try:
        def register(ident, pid):
            frame = p.encode(p.Request(v=p.PROTOCOL_VERSION, token="tok", rid=1,
                                       op=p.Register(info=info("a", pid=pid))))
            [(_, reply)] = service.handle(ident, [frame])
            return p.decode_reply(reply).body

        assert isinstance(register(b"live", 1), p.Ok)
        refused = register(b"impostor", 2)
        assert isinstance(refused, p.Error) and refused.code == "conflict"
        assert service.idents["a"] == b"live"
        assert hub.status(0.0).endpoints[0].pid == 1
    finally:
        service._sock.close(0)
        service._ctx.term()


def test_a_replaced_process_cannot_deregister_its_successor():
    hub = new_hub()
    reg(hub, 0, info("r", pid=1))
    hub.endpoints["r"].info.incarnation = "r-1"
    hub.expire(10.0)
    new = info("r", pid=2)
    new.incarnation = "r-2"
    hub.register(10.0, p.Register(info=new))
    with pytest.raises(HubFault) as exc:
        hub.deregister(10.0, p.Deregister(name="r", incarnation="r-1"))
    assert exc.value.code == "fenced" and "r" in hub.endpoints


def test_a_failure_report_alone_makes_no_replica():
    """After a reader let its partial replica go, a late failure report (a zombie that
    just stopped) must not leave a ghost replica behind."""
    hub = new_hub()
    reg(hub, 0, info("t"), info("r", node="n2"))
    hub.publish(0, p.Publish(name="t", model="m", version=1, manifest=manifest(2)))
    read = hub.plan(0, p.Plan(name="r", model="m", version=1, window=1)).reads[0]
    hub.cancel(0, p.Cancel(name="r", model="m", version=1))
    hub.unpublish(0, p.Unpublish(name="r", model="m", version=1))
    assert "r" not in hub.models["m"][1].replicas
    hub.progress(0, p.Progress(name="r", model="m", version=1, chunks=[], failed=[read]))
    assert "r" not in hub.models["m"][1].replicas


def test_a_restarted_hub_says_rebuilding_not_unavailable_while_holders_return():
    """Contract 7, found by `th bench faults` (kill_hub, ~1 run in 10): a reader that
    re-registered before the publisher had its plan answered UNAVAILABLE, and gave up."""
    hub = new_hub(now=100.0, grace_s=5.0)  # a fresh hub after a restart
    m = manifest(4)
    reg(hub, 100.0, info("r", node="n2"), holdings=[p.Holding(model="m", version=1, world=1, shards=[m], held=[0])])
    with pytest.raises(HubFault) as exc:
        hub.plan(100.5, p.Plan(name="r", model="m", version=1))
    assert exc.value.code == "rebuilding"
    reg(hub, 101.0, info("t"), holdings=[p.Holding(model="m", version=1, world=1, shards=[m], rank=0)])
    assert {r.source for r in hub.plan(101.0, p.Plan(name="r", model="m", version=1)).reads} == {"t"}
    hub.deregister(101.0, p.Deregister(name="t"))
    with pytest.raises(HubFault) as exc:  # past the grace period a gap is a gap
        hub.plan(106.0, p.Plan(name="r", model="m", version=1))
    assert exc.value.code == "unavailable"


def test_resolved_replies_come_from_a_cache_that_is_never_stale():
    """The service encodes a version's manifests once and splices them into every
    ``Resolved`` reply: byte for byte what encoding each reply would give, and never
    another version's (not one withdrawn and published again under the same number
    with another manifest), each with its own group round."""
    hub = new_hub()
    service = HubService(hub, "tok", "tcp://127.0.0.1:*", clock=lambda: 0.0)

    def call(op, rid=1):
        [(_, frame)] = service.handle(b"id", [p.encode(p.Request(v=p.PROTOCOL_VERSION, token="tok", rid=rid, op=op))])
        return frame

    try:
        reg(hub, 0, info("t"), info("r", node="n2", group="g"))
        first, second = manifest(4), manifest(6, salt=7)
        hub.publish(0, p.Publish(name="t", model="m", version=1, manifest=first))
        for rid in (5, 6):  # the second reply is served from the cache
            frame = call(p.Resolve(name="r", model="m", version=1), rid)
            direct = hub.resolve(0, p.Resolve(name="r", model="m", version=1))
            assert frame == p.encode(p.Reply(v=p.PROTOCOL_VERSION, rid=rid, body=direct))
            assert p.decode_reply(frame).body.shards == [first]
        assert hub.models["m"][1].encoded is not None  # (so the test above did read the cache)

        # The operator withdraws v1 whole; t publishes another v1: a new manifest.
        hub.withdraw(0, p.Withdraw(model="m", version=1))  # (nothing reads it: done at once)
        assert 1 not in hub.models["m"]
        hub.publish(0, p.Publish(name="t", model="m", version=1, manifest=second))
        assert p.decode_reply(call(p.Resolve(name="r", model="m", version=1))).body.shards == [second]

        # A group's rounds: the same version, another round number in each reply.
        frame = call(p.Resolve(name="r", model="m", group="g"))
        expected = p.Resolved(model="m", version=1, world=1, shards=[second], round=1)
        assert frame == p.encode(p.Reply(v=p.PROTOCOL_VERSION, rid=1, body=expected))
        fetch_all(hub, 0, "r", "m", 1)  # every member complete: the round is over
        body = p.decode_reply(call(p.Resolve(name="r", model="m", group="g"))).body
        assert (body.round, body.version, body.shards) == (2, 1, [second])

        # A reader that says it holds this very version gets no manifests spliced in.
        held = {1: p.manifest_digest(1, [second])}
        assert p.decode_reply(call(p.Resolve(name="r", model="m", known=held))).body.shards == []
    finally:
        service._sock.close(0)
        service._ctx.term()

