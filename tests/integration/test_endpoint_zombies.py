"""Contract 3 for reads a failed fetch left behind (zombies), with in-process endpoints
on the tcp engine and a real hub: a hub restart while they still run, and ``close``
before they stopped, never release their source's drain early."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from tensorhub_cli.endpoint import FetchError, connect
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .peers import wait_until
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def rig(token_file, monkeypatch):
    """A hub (restartable, expiry 1 s), a publisher of m@1 served at 1 MiB/s, and a
    reader whose failed fetch left 4 zombies: their engine confirms no stop until
    ``stoppable`` is set."""
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))  # 4 MiB chunks: each read takes 4 s
    address = f"tcp://127.0.0.1:{free_port()}"
    hub = {}
    hub["proc"], hub["client"] = start_hub(token_file, address, expiry_s=1.0)
    eps = []

    def restart() -> None:
        hub["client"].close()
        stop_child(hub["proc"])
        hub["proc"], hub["client"] = start_hub(token_file, address, expiry_s=1.0)

    try:
        pub = connect(address, TOKEN, name="pub", engine="tcp", heartbeat_s=0.2)
        eps.append(pub)
        reader = connect(address, TOKEN, name="reader", engine="tcp", heartbeat_s=0.2, call_timeout_s=0.5)
        eps.append(reader)
        data = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(4)}
        pub.publish("m", 1, data, chunk_bytes=4 << 20)
        stoppable = threading.Event()
        real_release = reader.tcp.release
        reader.tcp.release = lambda xfer: real_release(xfer) and stoppable.is_set()
        with pytest.raises(FetchError):
            reader.fetch("m", 1, into={k: torch.zeros_like(v) for k, v in data.items()}, window=4, timeout=2)
        assert not reader.zombies.idle(), "the failed fetch left no zombie: nothing to test"
        yield hub, restart, pub, reader, stoppable
    finally:
        for ep in eps:
            ep.close(drain_timeout=0)
        hub["client"].close()
        stop_child(hub["proc"])


def unpublish_in_background(pub) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (pub.unpublish("m", 1, timeout=30), done.set()), daemon=True).start()
    return done


def test_a_hub_restart_while_zombies_run_pins_them_again_and_withdraws_their_replica_after(rig):
    hub, restart, pub, reader, stoppable = rig
    restart()
    client = hub["client"]
    wait_until(lambda: {e.name for e in client.call(p.Status(), timeout=5).endpoints} == {"pub", "reader"}, 20,
               "both endpoints to register with the restarted hub")
    time.sleep(1.2)  # past the restarted hub's grace period: a drain may now be judged complete
    done = unpublish_in_background(pub)
    # before the fix: acknowledged at once (the re-registration carried no zombie reads)
    assert not done.wait(2.0), "unpublish returned while a zombie read of its memory still ran"
    stoppable.set()
    assert done.wait(10), "the zombies stopped, yet the unpublish did not complete"

    def withdrawn():
        return all(e.replicas == 0 for e in client.call(p.Status(), timeout=5).endpoints if e.name == "reader")

    wait_until(withdrawn, 10, "the reader's replica the re-registration made to be withdrawn")
    # (the withdrawing thread forgets the version once the hub's answer reaches it, a
    # moment after the hub's status already shows the replica gone)
    wait_until(reader.zombies.idle, 5, "the reader to forget what its failed fetch left")


def test_close_waits_for_zombies_before_it_deregisters(rig):
    _, _, pub, reader, stoppable = rig
    closed = threading.Event()
    threading.Thread(target=lambda: (reader.close(drain_timeout=20), closed.set()), daemon=True).start()
    done = unpublish_in_background(pub)
    # before the fix: close deregistered at once, which dropped the zombies' pins
    assert not done.wait(2.0), "unpublish returned while the closing reader's zombie reads still ran"
    assert not closed.is_set(), "close returned before its zombies stopped"
    stoppable.set()
    assert closed.wait(10), "the zombies stopped, yet close did not return"
    assert done.wait(10), "the zombies stopped, yet the unpublish did not complete"


def test_close_gives_up_on_zombies_after_its_drain_timeout_naming_them(rig, caplog):
    _, _, _, reader, _ = rig
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tensorhub.endpoint"):
        reader.close(drain_timeout=1.0)
    assert time.monotonic() - began < 8
    assert any("gave up" in r.getMessage() and "m@1" in r.getMessage() for r in caplog.records), caplog.text
