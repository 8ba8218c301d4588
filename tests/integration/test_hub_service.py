"""The hub process through real ZeroMQ sockets: refusals are answered, counted, harmless."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient, HubError

from ..conftest import free_port

pytestmark = pytest.mark.integration
TOKEN = "t" * 32


@pytest.fixture
def hub(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "tensorhub_cli.hub", "--bind", address,
                             "--token-file", str(token_file), "--expiry-s", "1.0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    client = HubClient(address, TOKEN)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.call(p.Status(), timeout=0.5)
            break
        except Exception:
            assert proc.poll() is None and time.monotonic() < deadline, "hub did not come up"
    yield address, client, proc
    client.close()
    proc.terminate()
    proc.wait(timeout=10)


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
