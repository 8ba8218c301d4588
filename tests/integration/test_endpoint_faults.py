"""Contract 3 under faults, with in-process endpoints on the tcp engine and a real hub:
slow heartbeat replies, reads that time out while their source is throttled."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorhub_cli.endpoint import EndpointError, FetchError, connect
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient, HubUnreachable
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .peers import wait_until
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def hub3(token_file):
    """A hub that expires endpoints after 3 s: long enough to outlive a 1 s slow beat."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address, expiry_s=3.0)
    eps = []

    def join(name: str, **kw):
        ep = connect(address, TOKEN, name=name, engine="tcp", heartbeat_s=0.2, **kw)
        eps.append(ep)
        return ep

    yield address, client, join
    for ep in eps:
        ep.close(drain_timeout=0)
    client.close()
    stop_child(proc)


def tensors(mib: int, chunks: int) -> dict:
    n = (mib << 20) // 4 // chunks
    return {f"w{i}": torch.full((n,), float(i)) for i in range(chunks)}


def slow_heartbeats(ep) -> None:
    """Every heartbeat reaches the hub, but its reply comes later than the beat's
    timeout: the endpoint sees HubUnreachable while the hub still knows it alive."""
    client = ep.service.client
    real = client.call

    def call(op, timeout=5.0):
        if isinstance(op, p.Heartbeat):
            client.send(op)
            time.sleep(timeout)
            raise HubUnreachable(f"no reply from hub within {timeout:.1f}s (test: delayed)")
        return real(op, timeout=timeout)

    client.call = call


def test_slow_heartbeat_replies_keep_pins_and_the_pending_unpublish(hub3, monkeypatch):
    _, client, join = hub3
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))  # each 2 MiB chunk takes over a second
    pub, reader = join("pub"), join("reader")
    pub.publish("m", 1, tensors(16, 8), chunk_bytes=2 << 20)
    slow_heartbeats(pub)
    slow_heartbeats(reader)
    into = tensors(16, 8)
    for t in into.values():
        t.zero_()
    result: dict = {}

    def fetch():
        try:
            result["version"] = reader.fetch("m", 1, into=into, window=8, timeout=60)
        except Exception as exc:  # reported to the test thread below
            result["error"] = exc

    t = threading.Thread(target=fetch)
    t.start()
    wait_until(lambda: (h := reader.replicas.get(("m", 1))) and h.reading, 20, "the reader's reads in flight")
    pub.unpublish("m", 1, timeout=60)  # before the fix: HubError "expired" (the hub dropped pub)
    held = reader.replicas.get(("m", 1))
    assert held is None or not held.reading, "unpublish returned with reads of its memory in flight"
    t.join(60)
    assert result.get("version") == 1, result
    assert all(torch.equal(into[k], v) for k, v in tensors(16, 8).items())
    counters = client.call(p.Status(), timeout=5).counters
    assert counters.get("expiries", 0) == 0, counters


def test_a_replaced_endpoint_is_fenced_its_fetch_fails_naming_it_and_it_stops_beating(hub3, monkeypatch):
    _, client, join = hub3
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))
    pub, old = join("pub"), join("x")
    pub.publish("m", 1, tensors(16, 8), chunk_bytes=2 << 20)
    result: dict = {}

    def fetch():
        try:
            result["version"] = old.fetch("m", 1, into=tensors(16, 8), window=8, timeout=60)
        except Exception as exc:  # reported to the test thread below
            result["error"] = exc

    t = threading.Thread(target=fetch)
    t.start()
    wait_until(lambda: (h := old.replicas.get(("m", 1))) and h.reading, 20, "the old process's reads in flight")
    new = join("x")  # same name, same pid, another incarnation: the hub replaces the old one
    t.join(30)
    assert isinstance(result.get("error"), FetchError) and "fenced" in str(result["error"]), result
    wait_until(lambda: not old.service._thread.is_alive(), 10, "the fenced service thread to stop")
    old.close(drain_timeout=0)  # must not deregister the process that replaced it
    time.sleep(0.5)
    names = [e.name for e in client.call(p.Status(), timeout=5).endpoints]
    assert names.count("x") == 1 and new.service.fenced is None


def test_a_timed_out_read_keeps_its_pin_until_the_transfer_really_stopped(hub3, monkeypatch):
    _, client, join = hub3
    # 4 MiB chunks served 1 MiB a second: each read is still receiving long after it timed out.
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))
    pub, reader = join("pub"), join("reader")
    pub.publish("m", 1, tensors(16, 4), chunk_bytes=4 << 20)
    xfers: list = []
    real_read = reader.tcp.read

    def read(*args, **kw):
        xfers.append(real_read(*args, **kw))
        return xfers[-1]

    reader.tcp.read = read
    result: dict = {}

    def fetch():
        try:
            result["version"] = reader.fetch("m", 1, into=tensors(16, 4), window=4, timeout=8, read_timeout=0.5)
        except Exception as exc:  # reported to the test thread below
            result["error"] = exc

    t = threading.Thread(target=fetch)
    t.start()
    wait_until(lambda: xfers, 20, "the reader's reads to start")
    pub.unpublish("m", 1, timeout=30)
    pending = [x for x in xfers if reader.tcp.state(x) == "pending"]
    assert not pending, f"unpublish returned while {len(pending)} read(s) of its memory were still receiving"
    t.join(30)
    assert isinstance(result.get("error"), FetchError), result


def test_reads_a_failed_fetch_could_not_stop_stay_pinned_until_they_do(hub3, monkeypatch):
    _, client, join = hub3
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))
    pub, reader = join("pub"), join("reader", call_timeout_s=0.5)
    pub.publish("m", 1, tensors(16, 4), chunk_bytes=4 << 20)
    stoppable = threading.Event()  # an engine slow to confirm a stop: not before the test says so
    real_release = reader.tcp.release
    reader.tcp.release = lambda xfer: real_release(xfer) and stoppable.is_set()
    with pytest.raises(FetchError):
        reader.fetch("m", 1, into=tensors(16, 4), window=4, timeout=2)  # every read still pending at the deadline
    done = threading.Event()
    t = threading.Thread(target=lambda: (pub.unpublish("m", 1, timeout=30), done.set()))
    t.start()
    assert not done.wait(2.0), "unpublish returned while the failed fetch's reads were not confirmed stopped"
    stoppable.set()
    assert done.wait(10), "the reads stopped, yet the unpublish did not complete"
    t.join(10)


def test_a_draining_unpublish_holds_up_no_other_hub_call_of_its_endpoint(hub3, monkeypatch):
    _, client, join = hub3
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))
    pub, reader = join("pub"), join("reader", call_timeout_s=0.5)
    pub.publish("m", 1, tensors(16, 4), chunk_bytes=4 << 20)
    stoppable = threading.Event()  # the reader's reads stay pinned, so pub's drain waits, until then
    real_release = reader.tcp.release
    reader.tcp.release = lambda xfer: real_release(xfer) and stoppable.is_set()
    with pytest.raises(FetchError):
        reader.fetch("m", 1, into=tensors(16, 4), window=4, timeout=2)
    drained, answered = threading.Event(), threading.Event()
    t = threading.Thread(target=lambda: (pub.unpublish("m", 1, timeout=30), drained.set()))
    t.start()
    try:
        assert not drained.wait(1.0), "the drain did not wait for the pinned reads"
        other = threading.Thread(target=lambda: (pub.versions(timeout=2), answered.set()), daemon=True)
        other.start()
        assert answered.wait(3), "a hub call of the same endpoint waited behind its unpublish's drain"
    finally:
        stoppable.set()
        t.join(15)
    assert drained.is_set(), "the reads stopped, yet the unpublish did not complete"


def lose_replies(monkeypatch, *ops) -> None:
    """Requests of these kinds reach the hub, but their replies come after the call's timeout."""
    real = HubClient.call

    def call(self, op, timeout=5.0):
        if isinstance(op, ops):
            self.send(op)
            time.sleep(timeout)
            raise HubUnreachable(f"no reply from hub within {timeout:.1f}s (test: delayed)")
        return real(self, op, timeout=timeout)

    monkeypatch.setattr(HubClient, "call", call)


def test_a_publish_that_timed_out_is_withdrawn_at_the_hub_before_its_memory_is_let_go(hub3, monkeypatch):
    _, client, join = hub3
    pub = join("pub")
    lose_replies(monkeypatch, p.Publish)
    with pytest.raises(EndpointError, match="withdrawn"):  # (4 s: past the hub's start-up grace, no drain ends)
        pub.publish("m", 1, tensors(1, 2), timeout=4.0)
    monkeypatch.undo()
    assert ("m", 1) not in pub.replicas
    versions = client.call(p.Versions(model="m"), timeout=5).versions
    assert all(v.replicas == 0 for v in versions), versions  # before the fix: READY, held by pub's let-go memory


def test_a_publish_whose_withdrawal_is_unanswered_too_keeps_its_memory_registered(hub3, monkeypatch):
    _, client, join = hub3
    pub = join("pub")
    lose_replies(monkeypatch, p.Publish, p.Unpublish)
    with pytest.raises(EndpointError, match="unpublish"):
        pub.publish("m", 1, tensors(1, 2), timeout=0.5)
    monkeypatch.undo()
    assert ("m", 1) in pub.replicas, "memory the hub may still route readers to was let go"
    pub.unpublish("m", 1, timeout=10)
    assert ("m", 1) not in pub.replicas


def test_a_retention_pull_beside_a_sync_fetch_of_the_same_version_shares_its_outcome(hub3, monkeypatch):
    """retain and th sync run on separate workers now: the second fetch of a version the
    first is still filling waits for it, as it did when they ran one after the other."""
    from tensorhub_cli.layout import allocate

    _, client, join = hub3
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(4 << 20))  # 8 MiB: about 2 s
    pub, agent = join("pub"), join("agent")
    pub.publish("m", 1, tensors(8, 4), chunk_bytes=2 << 20)
    results: list = []

    def fetch():
        try:
            results.append(agent.fetch("m", 1, into=allocate, timeout=30))
        except Exception as exc:  # reported to the test thread below
            results.append(exc)

    first = threading.Thread(target=fetch)
    first.start()
    wait_until(lambda: (h := agent.replicas.get(("m", 1))) and h.reading, 20, "the first fetch's reads")
    fetch()
    first.join(30)
    assert results == [1, 1], results
