"""`th publish --from` a safetensors file, then `th sync`, on a local cluster: every
rollout endpoint ends up with tensors equal to the file; failures name the endpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from .peers import Worker
from .test_local_cluster import cluster, th  # noqa: F401 (cluster is a fixture)

pytestmark = pytest.mark.integration


def rollout(name: str, cluster_name: str, node: str) -> Worker:
    return Worker("-", "-", name, extra=["--cluster", cluster_name, "--node", node])


def test_publish_from_a_checkpoint_then_sync_every_rollout(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    g = torch.Generator().manual_seed(11)
    ckpt = tmp_path / "ckpt.safetensors"
    save_file({"embed.weight": torch.randn(512, 1024, generator=g), "norm.weight": torch.randn(1024, generator=g),
               "head.bias": torch.randn(3, generator=g).to(torch.bfloat16)}, str(ckpt))
    workers = [rollout("rollout-0", name, "node2"), rollout("rollout-1", name, "node3")]
    try:
        for w in workers:
            assert w.ask("accept_sync", model="policy")["accepting"] == "policy"
        pub = th("publish", "policy", "--from", str(ckpt), "--node", "node1", "-c", name, check=True)
        assert "published policy@1" in pub.stdout
        synced = th("sync", "policy", "--role", "rollout", "-c", name, "--json", check=True)
        doc = json.loads(synced.stdout)
        assert doc["version"] == 1 and sorted(doc["targets"]) == ["rollout-0", "rollout-1"]
        for w in workers:
            assert w.ask("compare_file", path=str(ckpt))["equal"], w.name
        versions = json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout)
        complete = {h["name"] for h in versions[0]["holders"] if h["complete"]}
        assert complete >= {"agent-node1", "rollout-0", "rollout-1"}
        assert versions[0]["reliable_copies"] >= 1

        # A target that cannot take the version fails the sync, by name.
        workers.append(rollout("rollout-2", name, "node2"))  # never called accept_sync
        assert workers[-1].hello["ready"]
        failed = th("sync", "policy", "--role", "rollout", "-c", name, "--json")
        assert failed.returncode == 1
        assert "rollout-2" in failed.stderr and "accepts no sync" in failed.stderr
        assert "rollout-0" not in failed.stderr
    finally:
        for w in workers:
            w.stop()


def test_publish_and_sync_name_what_is_wrong(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    missing = th("publish", "policy", "--from", str(tmp_path / "nope.safetensors"), "-c", name)
    assert missing.returncode == 2 and "nope.safetensors: no such file" in missing.stderr
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint")
    bad = th("publish", "policy", "--from", str(junk), "-c", name)
    assert bad.returncode == 2 and "not a safetensors file" in bad.stderr
    node = th("publish", "policy", "--from", str(junk), "--node", "node9", "-c", name)
    assert node.returncode == 2 and "--node 'node9' is not in cluster" in node.stderr
    nothing = th("sync", "policy", "--role", "rollout", "-c", name)
    assert nothing.returncode == 2 and "no READY version" in nothing.stderr


def test_unpublishing_the_last_copy_makes_an_agent_pull_a_retained_one_first(cluster):  # noqa: F811
    name, _ = cluster
    trainer = rollout("trainer-0", name, "node1")
    reader = rollout("rollout-0", name, "node2")
    try:
        trainer.ask("publish", model="policy", version=1, seed=12, mib=4, chunk_mib=1)
        trainer.ask("unpublish", model="policy", version=1, timeout=60)  # returns after the drain + the copy
        versions = json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout)
        (v,) = versions
        holders = {h["name"]: h for h in v["holders"]}
        assert v["state"] == "READY" and "trainer-0" not in holders
        agents = [h for n, h in holders.items() if n.startswith("agent-") and h["complete"] and h["reliable"]]
        assert agents, holders  # the retained copy lives in an agent's host memory now
        res = reader.ask("fetch", model="policy", seed=12, mib=4)
        assert res.get("version") == 1 and res["equal"], res  # and it serves readers
    finally:
        trainer.stop()
        reader.stop()
