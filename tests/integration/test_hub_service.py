"""The hub process through real ZeroMQ sockets: refusals are answered, counted, harmless."""

from __future__ import annotations

from contextlib import contextmanager

import subprocess
import sys
import time

import pytest
import zmq

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient, HubError, HubUnreachable, wait_for_hub
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port

pytestmark = pytest.mark.integration
TOKEN = "t" * 32


def start_hub(token_file, address: str, expiry_s: float = 1.0, *extra: str) -> tuple[subprocess.Popen, HubClient]:
    proc = subprocess.Popen([sys.executable, "-m", "tensorhub_cli.hub", "--bind", address,
                             "--token-file", str(token_file), "--expiry-s", str(expiry_s), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_hub(address, TOKEN, timeout=15, alive=lambda: proc.poll() is None)
    except HubUnreachable as exc:
        stop_child(proc)
        raise AssertionError(f"{exc}: {proc.stdout.read().decode(errors='replace')}") from None
    return proc, HubClient(address, TOKEN)


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return path


@contextmanager
def running_hub(token_file):
    """A hub process on a free port: (address, client, proc); stopped by its PID on exit."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    try:
        yield address, client, proc
    finally:
        client.close()
        stop_child(proc)


@pytest.fixture
def hub(token_file):
    with running_hub(token_file) as started:
        yield started


def raw_exchange(address: str, frames: list[bytes]) -> p.Reply:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(5000), "no reply to a bad frame"
        return p.decode_reply(sock.recv())
    finally:
        sock.close()


def info(name: str) -> p.EndpointInfo:
    return p.EndpointInfo(name=name, node="n1", pid=1)


def test_bad_token_is_refused_and_changes_nothing(hub):
    address, good, _ = hub
    bad = HubClient(address, "x" * 32)
    try:
        with pytest.raises(HubError) as exc:
            bad.call(p.Register(info=info("intruder")), timeout=5)
        assert exc.value.code == "auth"
    finally:
        bad.close()
    status = good.call(p.Status(), timeout=5)
    assert [e.name for e in status.endpoints] == []
    assert status.counters.get("errors.auth") == 1


@pytest.mark.parametrize("frames,code", [
    ([b"\x00garbage\xff"], "malformed"),
    ([b"a", b"b"], "malformed"),
    ([b"\x81\xa1v\x01"], "malformed"),  # valid msgpack, not a Request
    ([b"\x00" * (p.MAX_FRAME + 1)], "too_large"),
])
def test_garbage_gets_an_error_reply_and_the_hub_survives(hub, frames, code):
    address, client, proc = hub
    reply = raw_exchange(address, frames)
    assert isinstance(reply.body, p.Error) and reply.body.code == code
    assert proc.poll() is None
    client.call(p.Register(info=info("after-garbage")), timeout=5)
    status = client.call(p.Status(), timeout=5)
    assert status.counters.get(f"errors.{code}") == 1
    assert [e.name for e in status.endpoints] == ["after-garbage"]


def test_foreign_protocol_version_is_refused(hub):
    address, client, _ = hub
    frame = p.encode(p.Request(v=99, token=TOKEN, rid=7, op=p.Status()))
    reply = raw_exchange(address, [frame])
    assert reply.rid == 7 and reply.body.code == "version"


def test_silent_endpoint_expires(hub):
    _, client, _ = hub
    client.call(p.Register(info=info("quiet")), timeout=5)
    time.sleep(1.6)
    status = client.call(p.Status(), timeout=5)
    assert "quiet" not in [e.name for e in status.endpoints]
    with pytest.raises(HubError) as exc:
        client.call(p.Heartbeat(name="quiet"), timeout=5)
    assert exc.value.code == "unknown_endpoint"


def manifest(nchunks: int) -> p.Manifest:
    tensors = [p.TensorMeta(name=f"w{i}", dtype="uint8", shape=[64], nbytes=64, offset=64 * i) for i in range(nchunks)]
    return p.Manifest(tensors=tensors, chunks=[p.ChunkMeta(nbytes=64, checksum=i) for i in range(nchunks)],
                      chunk_bytes=64)


def test_hub_restart_rebuilds_the_registry_and_a_reader_carries_on(token_file):
    """Kill -9 the hub mid-fetch; the new one learns everything back from re-registrations."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address, expiry_s=5.0)
    try:
        client.call(p.Register(info=info("trainer")), timeout=5)
        client.call(p.Register(info=p.EndpointInfo(name="reader", node="n2", pid=2)), timeout=5)
        client.call(p.Publish(name="trainer", model="policy", version=3, manifest=manifest(4)), timeout=5)
        first = client.call(p.Plan(name="reader", model="policy", version=3, window=2), timeout=5)
        done = [first.reads[0].chunk]
        client.call(p.Progress(name="reader", model="policy", version=3, chunks=done), timeout=5)
        reading = client.call(p.Plan(name="reader", model="policy", version=3, window=2), timeout=5).reads
        proc.kill()  # a crash, not a clean stop: nothing is saved
        proc.wait(timeout=10)
        client.close()

        proc, client = start_hub(token_file, address, expiry_s=5.0)
        assert client.call(p.Versions(), timeout=5).versions == []
        with pytest.raises(HubError) as exc:
            client.call(p.Heartbeat(name="trainer"), timeout=5)
        assert exc.value.code == "unknown_endpoint"  # what makes endpoints re-register
        client.call(p.Register(info=info("trainer"), holdings=[
            p.Holding(model="policy", version=3, world=1, shards=[manifest(4)], rank=0)]), timeout=5)
        client.call(p.Register(info=p.EndpointInfo(name="reader", node="n2", pid=2), holdings=[
            p.Holding(model="policy", version=3, world=1, shards=[manifest(4)], held=done, reading=reading)]),
            timeout=5)
        [v] = client.call(p.Versions(model="policy"), timeout=5).versions
        assert (v.version, v.state, v.chunks, v.replicas) == (3, "READY", 4, 2)
        # The reads in flight survived the crash: the next plan returns them, not new ones.
        again = client.call(p.Plan(name="reader", model="policy", version=3, window=2), timeout=5)
        assert sorted(r.chunk for r in again.reads) == sorted(r.chunk for r in reading)
        rest = [c for c in range(4) if c not in done]
        while rest:
            client.call(p.Progress(name="reader", model="policy", version=3,
                                   chunks=[r.chunk for r in again.reads]), timeout=5)
            rest = [c for c in rest if c not in {r.chunk for r in again.reads}]
            again = client.call(p.Plan(name="reader", model="policy", version=3, window=2), timeout=5)
        assert again.complete
        [v] = client.call(p.Versions(model="policy"), timeout=5).versions
        assert v.complete_replicas == 2
    finally:
        client.close()
        stop_child(proc)


def test_a_new_swarms_first_plans_are_answered_together_when_its_muster_closes(token_file):
    """The service's timer closes a muster: two readers asking at once, the one on the
    trainer's rack asking last, are both answered after ``--muster-s``, chained by rack."""
    import threading

    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address, 5.0, "--muster-s", "0.3")
    clients = [HubClient(address, TOKEN) for _ in range(2)]
    try:
        def place(name, rack):
            return p.EndpointInfo(name=name, node=f"node-{name}", rack=rack, pid=1)

        client.call(p.Register(info=place("t0", "ra")), timeout=5)
        client.call(p.Publish(name="t0", model="m", version=1, manifest=manifest(4)), timeout=5)
        answers, began = {}, time.monotonic()

        def ask(c, name, rack):
            c.call(p.Register(info=place(name, rack)), timeout=5)
            if name == "near":
                time.sleep(0.1)  # it asks second
            got = c.call(p.Plan(name=name, model="m", version=1, schedule=True), timeout=5)
            answers[name] = ({f.source for f in got.feeds}, time.monotonic() - began)

        threads = [threading.Thread(target=ask, args=(c, n, r)) for c, (n, r) in zip(clients, [("far", "rb"),
                                                                                                ("near", "ra")])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert answers["near"][0] == {"t0"} and answers["far"][0] == {"near"}, answers
        assert min(s for _, s in answers.values()) >= 0.25, f"answered before the muster closed: {answers}"
    finally:
        for c in [client, *clients]:
            c.close()
        stop_child(proc)
