"""Contract 9 across real torch.distributed groups: DTensors published by one gloo group,
fetched by another (or by a plain reader here), and a transformers Llama published by a
sharded trainer and fetched as vLLM tensor-parallel parameters.

Protocol. One hub process and three pools of ``dist_worker`` processes for the whole
module (spawning torch is the slow part): ``pub2`` and ``pub4`` (publishers, gloo worlds
of 2 and 4) and ``read2`` (readers, a gloo world of 2 of its own). Every case publishes
a model of its own as version 1, so cases do not see each other's holders. A worker
checks its bytes against the global tensors it rebuilds from the seed and answers what
it read; any worker's exception fails the test with its traceback, and a worker that
does not answer in time fails it with its log. Every worker is stopped by PID at the end.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tensorhub_cli.endpoint import connect
from tensorhub_cli.launch.procs import log_tail, stop_child

from ..conftest import REPO, free_port
from .dist_worker import CHUNK_BYTES, SMALL_BYTES, tensors
from .test_hub_service import TOKEN, start_hub

CALL_TIMEOUT_S = 90.0  # one op on every rank of a pool (first ops pay for imports)
READY_TIMEOUT_S = 150.0  # 8 processes importing torch on 2 shared cores
AFTER_ERROR_S = 5.0  # once one rank failed, how long the others get to answer


class Pool:
    """``world`` dist_worker processes of one gloo group, driven in lockstep."""

    def __init__(self, tag: str, world: int, hub: str, logs: Path):
        self.tag, self.procs, self.queues, self.logs, self.broken = tag, [], [], [], ""
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        for rank in range(world):
            log = logs / f"{tag}{rank}.log"
            self.logs.append(log)
            with open(log, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.integration.dist_worker", "--hub", hub, "--token", TOKEN,
                     "--name", f"{tag}-{rank}", "--rank", str(rank), "--world", str(world), "--port", str(port)],
                    cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
            self.procs.append(proc)
            q: queue.Queue = queue.Queue()
            # A reader thread per worker: replies wait in a queue, so a wait can time out.
            threading.Thread(target=self._drain, args=(proc, q), daemon=True).start()
            self.queues.append(q)

    @staticmethod
    def _drain(proc: subprocess.Popen, q: queue.Queue) -> None:
        for line in proc.stdout:
            if line.startswith(b"@@ "):
                q.put(json.loads(line[3:]))
        q.put(None)  # end of output: the worker exited

    def _collect(self, what: str, timeout: float) -> list[dict]:
        replies: list = [None] * len(self.procs)
        deadline = time.monotonic() + timeout
        problems: list[str] = []
        while any(r is None for r in replies) and time.monotonic() < deadline:
            for rank, q in enumerate(self.queues):
                if replies[rank] is not None:
                    continue
                try:
                    msg = q.get(timeout=0.02)
                except queue.Empty:
                    continue
                if msg is None:
                    msg = {"error": f"exited (rc {self.procs[rank].poll()})", "trace": ""}
                replies[rank] = msg
                if "error" in msg:
                    problems.append(f"{self.tag} rank {rank}: {msg['error']}\n{msg['trace']}")
                    # the others may be stuck in a collective with it
                    deadline = min(deadline, time.monotonic() + AFTER_ERROR_S)
        for rank, r in enumerate(replies):
            if r is None:
                problems.append(f"{self.tag} rank {rank}: no reply to {what} within {timeout:g}s; log:\n"
                                f"{log_tail(self.logs[rank], 30)}")
        if problems:
            self.broken = f"{self.tag} is broken since {what} failed"
            raise AssertionError("\n".join(problems))
        return replies

    def ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        self._collect("startup", timeout)

    def call(self, op: str, timeout: float = CALL_TIMEOUT_S, **args) -> list[dict]:
        """Run ``op`` on every rank; each rank's reply, in rank order."""
        assert not self.broken, self.broken
        line = (json.dumps({"op": op, **args}) + "\n").encode()
        for proc in self.procs:
            proc.stdin.write(line)
            proc.stdin.flush()
        return self._collect(op, timeout)

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.write(b'{"op": "exit"}\n')
                proc.stdin.close()
            except (BrokenPipeError, ValueError, OSError):
                pass  # already gone
        deadline = time.monotonic() + 20
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            stop_child(proc)  # by PID; a no-op once it exited


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    token = tmp_path_factory.mktemp("dist") / "token"
    token.write_text(TOKEN)
    address = f"tcp://127.0.0.1:{free_port()}"
    # A generous expiry: heartbeats of 8 processes on 2 cores can be late while torch loads.
    proc, client = start_hub(token, address, expiry_s=5.0)
    yield address
    client.close()
    stop_child(proc)


@pytest.fixture(scope="module")
def pools(hub, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dist-logs")
    started: dict[str, Pool] = {}
    try:
        for tag, world in (("pub2", 2), ("pub4", 4), ("read2", 2)):
            started[tag] = Pool(tag, world, hub, logs)
        for pool in started.values():  # they start together: spawn overlaps
            pool.ready()
        yield started
    finally:
        for pool in started.values():
            pool.close()


def nbytes(kind: str, seed: int) -> int:
    return sum(t.nbytes for t in tensors(kind, seed).values())


def assert_published_once(replies: list[dict], kind: str, seed: int) -> None:
    """Every byte of every global tensor is in exactly one publisher's manifest, and
    every publisher published something."""
    full = tensors(kind, seed)
    assert all(r["tensors"] for r in replies), [len(r["tensors"]) for r in replies]
    covered = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in full.items()}
    for r in replies:
        for name, _, shape, offsets in r["tensors"]:
            offsets = offsets or [0] * len(shape)
            covered[name][tuple(slice(o, o + s) for o, s in zip(offsets, shape))] += 1
    twice = {n: int((c != 1).sum()) for n, c in covered.items() if (c != 1).any()}
    assert not twice, f"elements published other than once, per tensor: {twice}"
    assert sum(nb for r in replies for _, nb, _, _ in r["tensors"]) == nbytes(kind, seed)


def assert_reads_its_share(replies: list[dict], total: int) -> None:
    """A Shard(1) reader of ``mixed`` reads its share and two roundings, never the
    whole set: the small tensors' packed chunks are read whole (< SMALL_BYTES in all),
    and so are ``e``'s chunks: cut on a middle dim, its 64-byte rows are narrower than
    a column strip, so they have no tiles; e's unneeded half is one chunk."""
    for rank, r in enumerate(replies):
        print(f"reader {rank}: read {r['bytes']} B, share {r['share']} B, set {total} B")
        assert r["share"] <= r["bytes"] <= r["share"] + CHUNK_BYTES + SMALL_BYTES, r
        assert r["bytes"] < total, (r, total)


def fetch_whole(hub: str, model: str, full: dict) -> dict:
    with connect(hub, TOKEN, name=f"whole-{model}", engine="tcp", chunk_bytes=CHUNK_BYTES,
                 small_bytes=SMALL_BYTES, heartbeat_s=0.2) as ep:
        into = {n: torch.zeros_like(t) for n, t in full.items()}
        assert ep.fetch(model, 1, into=into, timeout=60) == 1
        for name, t in full.items():
            assert into[name].dtype == t.dtype and torch.equal(into[name], t), name
        shards = ep.replicas.get((model, 1)).shards  # the manifests the hub resolved for us
        return {**ep.last_fetch, "shards": [[(t.name, t.nbytes) for t in m.tensors] for m in shards]}


@pytest.mark.parametrize("pub,model,build", [("pub2", "c1", "distribute"), ("pub4", "c2", "from_local")])
def test_shard0_publishers_to_shard1_dtensor_readers_in_another_group(pools, pub, model, build):
    seed = 1 if pub == "pub2" else 2
    published = pools[pub].call("publish", model=model, kind="mixed", seed=seed, mesh=[len(pools[pub].procs)],
                                placements="s0")
    assert_published_once(published, "mixed", seed)
    read = pools["read2"].call("fetch", model=model, kind="mixed", seed=seed, placements="s1", build=build)
    assert_reads_its_share(read, nbytes("mixed", seed))


def test_replicated_publishers_publish_each_byte_once_to_a_whole_reader(pools, hub):
    published = pools["pub2"].call("publish", model="c3", kind="mixed", seed=3, mesh=[2], placements="r")
    assert_published_once(published, "mixed", 3)
    got = fetch_whole(hub, "c3", tensors("mixed", 3))
    total = nbytes("mixed", 3)
    # the hub's view: two shards, both non-empty, together one copy of the bytes
    assert len(got["shards"]) == 2 and all(got["shards"]), got["shards"]
    assert sum(nb for shard in got["shards"] for _, nb in shard) == total
    print(f"whole reader of replicated c3: read {got['bytes']} B of {total} B")
    assert total <= got["bytes"] <= total + SMALL_BYTES, (got["bytes"], total)


@pytest.mark.parametrize("pub,model", [("pub2", "c4a"), ("pub4", "c4b")])
def test_uneven_shard0_with_empty_shards_to_a_whole_reader(pools, hub, pub, model):
    world = len(pools[pub].procs)
    published = pools[pub].call("publish", model=model, kind="uneven", seed=4, mesh=[world], placements="s0")
    assert_published_once(published, "uneven", 4)
    names = [{name for name, *_ in r["tensors"]} for r in published]
    # torch.chunk sizes: a rank with no rows leaves the tensor out ("one" has 1 row)
    assert all("one" not in n for n in names[1:]), names
    if world == 4:
        assert names[3] == {"seven"}, names  # 5 and 3 rows over 4 leave rank 3 empty
    got = fetch_whole(hub, model, tensors("uneven", 4))
    assert got["bytes"] >= nbytes("uneven", 4)


def test_fsdp2_state_dict_with_plain_buffers_publishes_each_byte_once(pools, hub):
    """FSDP2 leaves buffers plain on every rank: mesh rank 0 alone publishes them, so
    the version covers each tensor once (the hub refused it as overlapping before)
    and a reader gets every byte of parameters and buffers."""
    published = pools["pub2"].call("fsdp_publish", model="c6", seed=7)
    assert_published_once(published, "fsdp", 7)
    names = [{name for name, *_ in r["tensors"]} for r in published]
    assert {"inv_freq", "cache"} <= names[0] and not {"inv_freq", "cache"} & names[1], names
    got = fetch_whole(hub, "c6", tensors("fsdp", 7))  # checks every byte
    assert got["bytes"] >= nbytes("fsdp", 7)


@pytest.mark.parametrize("placements,model", [("s0,r", "c5a"), ("r,s1", "c5b")])
def test_2d_mesh_publishers_to_shard1_readers(pools, placements, model):
    published = pools["pub4"].call("publish", model=model, kind="mixed", seed=5, mesh=[2, 2],
                                   placements=placements)
    assert_published_once(published, "mixed", 5)  # the replicas split what they both hold
    read = pools["read2"].call("fetch", model=model, kind="mixed", seed=5, placements="s1", build="distribute")
    assert_reads_its_share(read, nbytes("mixed", 5))


def test_llama_from_a_sharded_trainer_into_vllm_tp2_params(pools):
    trained = pools["pub2"].call("llama_publish", model="llama", seed=6)
    read = pools["read2"].call("llama_fetch", model="llama", seed=6)
    model_bytes = trained[0]["bytes"]
    for rank, r in enumerate(read):
        assert r["model_bytes"] == model_bytes
        share, got = r["share"], r["bytes"]
        print(f"llama TP rank {rank}/2: read {got} B, share {share} B ({got / share:.4f}x), model {model_bytes} B")
        assert share <= got <= share * 1.10 + CHUNK_BYTES, r
        assert got < 0.6 * model_bytes, r  # a TP-2 rank reads about half, never the whole model
