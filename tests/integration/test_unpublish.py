"""`th unpublish` on a local cluster: a version withdrawn from one node's holders, then
from all; each holder really lets its memory go (it can take the version again into
the same place), retention copies nothing of a withdrawn version, and bad input is
named. `th publish` of a model the spec does not declare says which defaults it used."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from .peers import Worker
from .test_local_cluster import cluster, th  # noqa: F401 (cluster is a fixture)

pytestmark = pytest.mark.integration


def holders(name: str, model: str = "policy") -> dict[str, bool]:
    listed = json.loads(th("versions", model, "-c", name, "--json", check=True).stdout)
    return {h["name"]: h["complete"] for v in listed for h in v["holders"]}


def test_unpublish_from_one_node_then_everywhere(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    ckpt = tmp_path / "ckpt.safetensors"
    save_file({"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(5))}, str(ckpt))
    reader = Worker("-", "-", "rollout-0", extra=["--cluster", name, "--node", "node2"])
    try:
        assert reader.ask("accept_sync", model="policy")["accepting"] == "policy"
        th("publish", "policy", "--from", str(ckpt), "--node", "node1", "-c", name, check=True)
        th("sync", "policy", "--role", "rollout", "-c", name, "--json", check=True)
        assert holders(name) == {"agent-node1": True, "rollout-0": True}

        for argv, needle in ((["policy", "9"], "policy@9 is not known"),
                             (["policy", "1", "--node", "node9"], "--node 'node9' is not in cluster"),
                             (["policy", "1", "--node", "node3"], "no endpoint on node 'node3' holds policy@1")):
            bad = th("unpublish", *argv, "-c", name)
            assert bad.returncode == 2 and needle in bad.stderr, bad.stderr

        one = th("unpublish", "policy", "1", "--node", "node2", "-c", name, "--timeout", "30", check=True)
        assert "unpublished policy@1 on node2 from 1 endpoint(s): rollout-0" in one.stdout
        assert holders(name) == {"agent-node1": True}
        # rollout-0 let its copy go (its unpublish command ran before this fetch, on the
        # same worker): fetching again into the same memory makes it a holder again.
        th("sync", "policy", "--role", "rollout", "-c", name, "--json", "--timeout", "30", check=True)
        assert reader.ask("compare_file", path=str(ckpt))["equal"]

        # Every holder: the last reliable copy goes too; no agent is asked to keep one.
        every = th("unpublish", "policy", "1", "-c", name, "--timeout", "30", check=True)
        assert "unpublished policy@1 from 2 endpoint(s): agent-node1, rollout-0" in every.stdout
        assert json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout) == []
        # agent-node1 let go as well: it can load and publish policy@1 again.
        again = th("publish", "policy", "--from", str(ckpt), "--version", "1", "--node", "node1", "-c", name)
        assert again.returncode == 0 and "published policy@1" in again.stdout, again.stderr
    finally:
        reader.stop()


def test_publish_of_an_undeclared_model_says_which_defaults_it_used(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    ckpt = tmp_path / "ckpt.safetensors"
    save_file({"w": torch.ones(1024)}, str(ckpt))
    pub = th("publish", "polcy", "--from", str(ckpt), "--node", "node1", "-c", name, check=True)
    assert "published polcy@1" in pub.stdout
    assert "model 'polcy' is not declared" in pub.stderr and "(models: policy)" in pub.stderr
    assert "16 MiB chunks" in pub.stderr
    undone = th("unpublish", "polcy", "1", "-c", name, "--timeout", "30", check=True)
    assert "from 1 endpoint(s): agent-node1" in undone.stdout
    declared = th("publish", "policy", "--from", str(ckpt), "--node", "node1", "-c", name, check=True)
    assert "not declared" not in declared.stderr


def test_unpublish_that_cannot_drain_in_time_names_who_holds_it(cluster):  # noqa: F811
    """A read in flight holds the drain back (contract 3): the hub's answer at the
    deadline names the holder and why, and `th unpublish` exits 1 with it."""
    import os
    import threading

    from tensorhub_cli.hub import protocol as p
    from tensorhub_cli.hub.client import HubClient
    from tensorhub_cli.launch.state import read_state, read_token

    name, _ = cluster
    address, token = read_state(name).hub_address, read_token(name)
    stop = threading.Event()

    def beat(who):  # each fake endpoint its own socket (one per thread)
        client = HubClient(address, token)
        client.call(p.Register(info=p.EndpointInfo(name=who, node="node1", pid=os.getpid())))
        while not stop.wait(0.2):
            client.call(p.Heartbeat(name=who))
        client.close()

    beaters = [threading.Thread(target=beat, args=(who,)) for who in ("trainer-x", "reader-x")]
    client = HubClient(address, token)
    try:
        for t in beaters:
            t.start()
        tensors = [p.TensorMeta(name="w", dtype="uint8", shape=[2048], nbytes=2048, offset=0)]
        chunks = [p.ChunkMeta(nbytes=1024, checksum=1), p.ChunkMeta(nbytes=1024, checksum=2)]
        for _ in range(50):  # until both registered
            if {"trainer-x", "reader-x"} <= {e.name for e in client.call(p.Status()).endpoints}:
                break
            stop.wait(0.1)
        client.call(p.Publish(name="trainer-x", model="policy", version=7,
                              manifest=p.Manifest(tensors=tensors, chunks=chunks, chunk_bytes=1024)))
        planned = client.call(p.Plan(name="reader-x", model="policy", version=7, window=1))
        assert [r.source for r in planned.reads] == ["trainer-x"]  # pinned, never reported
        late = th("unpublish", "policy", "7", "-c", name, "--timeout", "1")
        assert late.returncode == 1, late.stderr
        assert "policy@7 is still held after 1s by" in late.stderr
        assert "trainer-x (1 read(s) from it in flight)" in late.stderr
        assert "reader-x (1 read(s) of its own in flight)" in late.stderr
        # The read ends: the drains it held back go on to the end, and the version goes.
        client.call(p.Cancel(name="reader-x", model="policy", version=7))
        assert json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout) == []
    finally:
        stop.set()
        for t in beaters:
            if t.is_alive():
                t.join(timeout=10)
        client.close()
