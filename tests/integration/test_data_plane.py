"""The data plane with real processes on loopback: fetch fan-out, failures, integrity,
layout checks and unpublish-drain (contracts 3, 5, 6), over both engines."""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubError

from ..conftest import free_port
from .peers import Worker, wait_until
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def hub(token_file):
    from tensorhub_cli.launch.procs import stop_child

    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    workers: list[Worker] = []

    def spawn(name: str, engine: str = "nixl", **kw) -> Worker:
        w = Worker(address, TOKEN, name, engine, **kw)
        workers.append(w)
        return w

    yield address, client, spawn
    for w in workers:
        w.stop()
    client.close()
    stop_child(proc)


def holder(client, model: str, version: int, name: str) -> p.HolderStatus | None:
    for v in client.call(p.Versions(model=model)).versions:
        if v.version == version:
            return next((h for h in v.holders if h.name == name), None)
    return None


@pytest.mark.parametrize("engine", ["nixl", "tcp"])
def test_four_readers_fetch_64_mib_at_once_and_relay_chunks_to_each_other(hub, engine):
    _, client, spawn = hub
    pub = spawn("pub", engine)
    readers = [spawn(f"r{i}", engine) for i in range(4)]
    assert pub.hello["engine"] == engine and all(r.hello["engine"] == engine for r in readers)
    assert pub.ask("publish", model="m", version=1, seed=7, mib=64, chunk_mib=2)["chunks"] > 30
    for r in readers:
        r.send("fetch", model="m", seed=7, mib=64, window=2)
    results = [r.recv(120) for r in readers]
    for r, res in zip(readers, results):
        assert res.get("version") == 1, (r.name, res)
        assert res["equal"], r.name  # torch.equal on every tensor, against bytes rebuilt from the seed
        assert res["stats"]["corrupt"] == 0
    counters = client.call(p.Status()).counters
    assert counters.get("reads_from_readers", 0) > 0, counters  # some chunks came from non-publishers
    versions = client.call(p.Versions(model="m")).versions
    assert versions[0].complete_replicas == 5


def test_source_killed_midway_the_fetch_completes_from_the_others(hub):
    _, client, spawn = hub
    # Per connection: the reader's 32 MiB over 4 connections take about 4 s; it reports
    # to the hub once, at the end (``endpoint.reader.batch``), and its beats (every
    # 0.2 s here) tell the hub how far it is (``Heartbeat.filling``).
    slow = {"TH_TEST_SERVE_BPS": str(2 << 20)}
    pub = spawn("pub", "tcp", env=slow)
    second = spawn("second", "tcp", env=slow)
    reader = spawn("reader", "tcp")
    pub.ask("publish", model="m", version=1, seed=3, mib=32, chunk_mib=1)
    assert second.ask("fetch", model="m", seed=3, mib=32, window=16, timeout=60)["equal"]
    reader.send("fetch", model="m", seed=3, mib=32, window=4, timeout=60)
    wait_until(lambda: (h := holder(client, "m", 1, "reader")) and h.held_bytes > 0, 60, "a beat with progress")
    assert holder(client, "m", 1, "reader").held_bytes < 32 << 20  # the kill lands mid-fetch
    second.kill()  # its source: the hub feeds a reader from readers before publishers
    res = reader.recv(90)
    assert res.get("version") == 1 and res["equal"], res
    assert res["stats"]["failed"] >= 1, f"the kill did not cut a read of the fetch: {res['stats']}"
    assert res["stats"]["from_publishers"] > 0, f"the rest did not come from the publisher: {res['stats']}"


def test_last_holder_killed_gives_a_clear_error_not_a_hang(hub):
    _, client, spawn = hub
    pub = spawn("pub", "tcp", env={"TH_TEST_SERVE_BPS": str(2 << 20)})
    reader = spawn("reader", "tcp")
    pub.ask("publish", model="m", version=1, seed=4, mib=16, chunk_mib=1)
    reader.send("fetch", model="m", seed=4, mib=16, window=4, timeout=60)
    wait_until(lambda: holder(client, "m", 1, "reader"), 30, "reader started")
    pub.kill()
    res = reader.recv(60)
    assert res.get("type") == "FetchError" and "UNAVAILABLE" in res["error"], res
    # a failed fetch leaves no replica behind: the reader never looks like a holder
    wait_until(lambda: holder(client, "m", 1, "reader") is None, 10, "the reader's partial replica to go")


@pytest.mark.parametrize("engine", ["nixl", "tcp"])
def test_a_corrupt_chunk_is_detected_and_fetched_from_another_holder(hub, engine):
    _, client, spawn = hub
    bad = spawn("bad", engine)
    good = spawn("good", engine)
    reader = spawn("reader", engine)
    bad.ask("publish", model="m", version=1, seed=5, mib=8, chunk_mib=1)
    bad.ask("corrupt", model="m", version=1, chunk=3)  # one byte of a holder's chunk, after its checksum
    reader.send("fetch", model="m", seed=5, mib=8, timeout=60)
    wait_until(lambda: client.call(p.Status()).counters.get("reads_failed", 0) >= 1, 30, "the corrupt read")
    good.ask("publish", model="m", version=1, seed=5, mib=8, chunk_mib=1)  # a clean holder appears
    res = reader.recv(60)
    assert res.get("version") == 1 and res["equal"], res
    assert res["stats"]["corrupt"] >= 1


def test_wrong_shape_or_dtype_is_one_clear_error_and_writes_nothing(hub):
    _, client, spawn = hub
    pub = spawn("pub")
    reader = spawn("reader")
    pub.ask("publish", model="m", version=1, seed=6, mib=4, chunk_mib=1)
    res = reader.ask("fetch_into_wrong", model="m", seed=6, mib=4)
    assert res["type"] == "LayoutError"
    assert "layer0.weight: shape [7]" in res["error"] and "layer1.weight: dtype float64" in res["error"]
    assert res["unchanged"]
    assert holder(client, "m", 1, "reader") is None


def test_unpublish_waits_for_a_slow_read_and_the_reader_gets_the_old_bytes(hub):
    _, client, spawn = hub
    # Per connection, and the reader reads all 8 chunks side by side: each 1 MiB chunk takes
    # 4 s, so the reader stays mid-read for seconds (at 1 MiB/s a busy machine's first poll
    # could come after the last byte).
    pub = spawn("pub", "tcp", env={"TH_TEST_SERVE_BPS": str(256 << 10)})
    # (Whole chunks: the hook sleeps after each read it serves, and a chain head reading
    # in fragments would make as many sleeps, one after another, as the unpublish's 30 s.)
    reader = spawn("reader", "tcp", env={"TH_RELAY_FRAGMENTS": "1"})
    pub.ask("publish", model="m", version=1, seed=8, mib=8, chunk_mib=1)
    reader.send("fetch", model="m", seed=8, mib=8, window=32, timeout=60)  # every chunk in flight at once
    wait_until(lambda: holder(client, "m", 1, "reader"), 30, "the reader's first reads")
    assert holder(client, "m", 1, "reader").held_bytes < 8 << 20  # still mid-read
    unpublished = pub.ask("unpublish", model="m", version=1, timeout=60)
    pub.ask("overwrite", model="m", version=1)  # the publisher reuses its buffer at once
    res = reader.recv(60)
    assert res.get("version") == 1 and res["equal"], res  # the old bytes, intact
    assert unpublished["t_done"] >= res["t_done"] - 0.5  # (monotonic clock, shared by processes)


def test_a_restarted_hub_rebuilds_from_endpoint_holdings_and_serves_new_readers(token_file):
    from tensorhub_cli.launch.procs import stop_child

    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    workers = [Worker(address, TOKEN, name) for name in ("pub", "reader", "late")]
    pub, reader, late = workers
    try:
        pub.ask("publish", model="m", version=1, seed=9, mib=8, chunk_mib=1)
        assert reader.ask("fetch", model="m", seed=9, mib=8)["equal"]
        client.close()
        stop_child(proc)  # every reference the hub had is gone with it
        proc, client = start_hub(token_file, address)
        def rebuilt():
            try:
                (v,) = client.call(p.Versions(model="m")).versions
            except HubError:  # not_found until the first holder re-registers
                return False
            return v.state == "READY" and v.complete_replicas == 2

        wait_until(rebuilt, 30, "endpoints to re-register what they hold")
        res = late.ask("fetch", model="m", seed=9, mib=8)
        assert res.get("version") == 1 and res["equal"], res
    finally:
        for w in workers:
            w.stop()
        client.close()
        stop_child(proc)


@pytest.mark.parametrize("fragments", ["4", "1"])
def test_a_relay_serves_fragments_it_has_not_verified_and_its_child_still_gets_exact_bytes(hub, fragments):
    """A chain of two behind a slow publisher: with fragments, the child reads parts of
    chunks its parent is still reading (``early_fragments``) and verifies each whole
    chunk; relaying whole chunks (TH_RELAY_FRAGMENTS=1) it never does."""
    _, client, spawn = hub
    pub = spawn("pub", "tcp", env={"TH_TEST_SERVE_BPS": str(8 << 20)})  # a 4 MiB chunk in 0.5 s
    readers = [spawn(f"r{i}", "tcp", env={"TH_RELAY_FRAGMENTS": fragments}) for i in range(2)]
    pub.ask("publish", model="m", version=1, seed=3, mib=16, chunk_mib=4)
    for r in readers:
        r.send("fetch", model="m", seed=3, mib=16, window=2)
    results = [r.recv(120) for r in readers]
    for r, res in zip(readers, results):
        assert res.get("version") == 1 and res["equal"], (r.name, res)
        assert res["stats"]["corrupt"] == 0, (r.name, res["stats"])
    early = sum(res["stats"]["early_fragments"] for res in results)
    assert (early > 0) == (fragments != "1"), [res["stats"] for res in results]
    assert client.call(p.Status()).counters.get("reads_from_readers", 0) > 0
