"""Delta reads between real processes (``wire.ReadDelta``): a reader in another DC that
holds v reads v+1 as deltas from a holder of both, rebuilds and verifies every chunk;
a delta made against other bytes than the reader's is refused and that chunk read in
full; within a DC reads stay full unless the hub is told ``--deltas all``."""

from __future__ import annotations

import pytest

from tensorhub_cli.engines import wire

from ..conftest import free_port
from .peers import Worker
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

MIB, CHUNK_MIB = 2, 0.25


@pytest.fixture
def cluster(token_file):  # noqa: F811
    from tensorhub_cli.launch.procs import stop_child

    made = []

    def start(*hub_args: str):
        address = f"tcp://127.0.0.1:{free_port()}"
        proc, client = start_hub(token_file, address, 5.0, *hub_args)
        made.append((proc, client))

        def spawn(name: str, dc: str, engine: str = "tcp") -> Worker:
            w = Worker(address, TOKEN, name, engine, extra=["--dc", dc, "--rack", f"{dc}-r"])
            made.append(w)
            return w
        return spawn

    yield start
    for m in reversed(made):
        if isinstance(m, Worker):
            m.stop()
        else:
            m[1].close()
            stop_child(m[0])


def publish_two(trainer: Worker) -> int:
    chunks = 0
    for version in (1, 2):
        reply = trainer.ask("publish", model="m", version=version, seed=5, mib=MIB, step=version - 1,
                            chunk_mib=CHUNK_MIB)
        assert "error" not in reply, reply
        chunks = reply["chunks"]
    return chunks


def fetch(reader: Worker, version: int) -> dict:
    reply = reader.ask("fetch", model="m", version=version, seed=5, mib=MIB, step=version - 1, timeout=60)
    assert "error" not in reply, reply
    assert reply["equal"], f"v{version}'s bytes differ from the trainer's"
    return reply["stats"]


@pytest.mark.parametrize("engine", ["tcp", "nixl"])
def test_a_far_reader_reads_the_next_version_as_deltas_and_gets_exact_bytes(cluster, engine):
    spawn = cluster()
    trainer, reader = spawn("trainer", "a", engine), spawn("far", "b", engine)
    chunks = publish_two(trainer)
    first = fetch(reader, 1)
    assert first["delta_reads"] == 0  # nothing to make a delta against yet
    second = fetch(reader, 2)
    assert second["delta_reads"] == chunks, second
    assert second["delta_failed"] == 0 and second["corrupt"] == 0, second
    # 2 % of the elements changed by one bit: the deltas are a small share of the version
    assert 0 < second["delta_wire_bytes"] < 0.25 * second["bytes"], second


def test_a_delta_made_against_other_bytes_is_refused_and_the_chunk_read_in_full(cluster):
    spawn = cluster()
    trainer, reader = spawn("trainer", "a"), spawn("far", "b")
    publish_two(trainer)
    fetch(reader, 1)
    # the trainer's v1 now differs from the reader's in chunk 0: a delta against it is wrong
    assert "error" not in trainer.ask("corrupt", model="m", version=1, chunk=0)
    second = fetch(reader, 2)  # (fetch asserts the bytes equal v2's)
    assert second["delta_failed"] == 1, second
    assert second["corrupt"] == 0 and second["failed"] == 0, second


@pytest.mark.parametrize("mode, expect_deltas", [("remote", False), ("all", True), ("off", False)])
def test_within_a_dc_reads_are_deltas_only_when_the_hub_says_all(cluster, mode, expect_deltas):
    spawn = cluster("--deltas", mode)
    trainer, reader = spawn("trainer", "a"), spawn("near", "a")
    publish_two(trainer)
    fetch(reader, 1)
    second = fetch(reader, 2)
    assert (second["delta_reads"] > 0) is expect_deltas, second


def test_a_holder_refuses_a_delta_of_what_it_does_not_hold_whole(cluster):
    spawn = cluster()
    trainer = spawn("trainer", "a")
    publish_two(trainer)
    address = trainer.ask("peer")["address"]
    payload, full = wire.read_delta(address, TOKEN, "m", 2, 1, 0, int(CHUNK_MIB * 2**20), 10.0)
    assert not full and 0 < len(payload) < CHUNK_MIB * 2**20 / 4
    with pytest.raises(wire.PeerError, match="not_found"):
        wire.read_delta(address, TOKEN, "m", 3, 1, 0, int(CHUNK_MIB * 2**20), 10.0)
    with pytest.raises(wire.PeerError, match="bad_request"):
        wire.read_delta(address, TOKEN, "m", 1, 2, 0, int(CHUNK_MIB * 2**20), 10.0)
    with pytest.raises(wire.PeerError, match="not_found"):
        wire.read_delta(address, TOKEN, "m", 2, 1, 10_000, int(CHUNK_MIB * 2**20), 10.0)
