"""The agent store's files (agent/store.py) without processes: what survives, what is
dropped, and that re-adopted memory serves the manifest's exact chunks."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tensorhub_cli.agent.commands import AgentCommands
from tensorhub_cli.agent.store import Store, StoreError, agent_dir
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.layout import lay_out

TOKEN = "t" * 32


def shard(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {f"s{seed}.w{i}": torch.randn(300_000, generator=g) for i in range(2)}  # 1.2 MB: chunked in place
    for i in range(5):  # small: packed into chunks that span tensors (staged on placement)
        sd[f"s{seed}.b{i}"] = torch.randn(1000 + i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
    sd[f"s{seed}.step"] = torch.tensor([seed], dtype=torch.int64)
    return sd


@pytest.fixture
def version():
    """Two shards (world 2): their manifests, and every tensor by name."""
    sds = [shard(1), shard(2)]
    manifests = [lay_out(sd, chunk_bytes=1 << 19, small_bytes=1 << 20)[0] for sd in sds]
    return manifests, {k: v for sd in sds for k, v in sd.items()}


def stored(root, version, *, complete=True) -> Store:
    manifests, want = version
    store = Store.open(root, TOKEN)
    into = store.allocate("org/m", 3, manifests)
    for name, t in want.items():
        into[name].copy_(t)  # what a fetch writes
    if complete:
        store.complete("org/m", 3)
    store.close()
    return store


def test_a_complete_copy_is_re_adopted_and_serves_the_manifests_exact_chunks(tmp_path, version, caplog):
    manifests, want = version
    stored(tmp_path, version)
    caplog.set_level(logging.INFO, "tensorhub.agent")
    store = Store.open(tmp_path, TOKEN)
    [copy] = store.recover()
    assert (copy.model, copy.version, copy.world, copy.rank) == ("org/m", 3, 2, -1)
    assert copy.shards == manifests
    assert all(torch.equal(copy.tensors[k], v) for k, v in want.items())
    # Each chunk as it will be served, staged ones included, hashes to the manifest's checksum.
    expected = [c.checksum for m in manifests for c in m.chunks]
    assert copy.placed.scatter, "the fixture must have chunks that span tensors"
    assert [copy.placed.checksum(c) for c in range(len(expected))] == expected
    assert "re-adopted stored copy org/m@3" in caplog.text


def test_the_tensors_are_the_files_memory(tmp_path, version):
    manifests, _ = version
    store = Store.open(tmp_path, TOKEN)
    into = store.allocate("m", 1, manifests)
    name = manifests[0].tensors[0].name
    into[name].view(-1)[0] = 1.5
    data = (store.path("m", 1) / "data").read_bytes()
    assert torch.frombuffer(bytearray(data[:4]), dtype=torch.float32).item() == 1.5
    assert (store.path("m", 1) / "manifest").exists() and not (store.path("m", 1) / "complete").exists()


def test_an_incomplete_copy_is_deleted_not_adopted(tmp_path, version, caplog):
    store = stored(tmp_path, version, complete=False)
    assert store.path("org/m", 3).is_dir()
    store = Store.open(tmp_path, TOKEN)
    assert store.recover() == []
    assert not store.path("org/m", 3).exists()
    assert "dropped stored copy org%2Fm@3: incomplete" in caplog.text


@pytest.mark.parametrize("where", ["in place", "staged"])  # a chunk inside one tensor; one spanning small ones
def test_a_copy_with_a_flipped_byte_is_dropped_naming_it(tmp_path, version, caplog, where):
    _, want = version
    store = stored(tmp_path, version)
    data = store.path("org/m", 3) / "data"
    raw = bytearray(data.read_bytes())
    # the first tensor (s1.w0) starts the file; shard 2's step is the last tensor in it
    at = 0 if where == "in place" else raw.rfind(want["s2.step"].numpy().tobytes())
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    store = Store.open(tmp_path, TOKEN)
    assert store.recover() == []
    assert not store.path("org/m", 3).exists()
    assert "dropped stored copy org%2Fm@3: checksum differs" in caplog.text


def test_a_copy_from_another_cluster_or_a_truncated_one_is_dropped(tmp_path, version, caplog):
    stored(tmp_path, version)
    other = Store.open(tmp_path, "another token")
    assert other.recover() == []
    assert "another cluster" in caplog.text
    other.close()
    store = stored(tmp_path, version)
    data = store.path("org/m", 3) / "data"
    data.write_bytes(data.read_bytes()[:100])
    assert Store.open(tmp_path, TOKEN).recover() == []
    assert "data is 100 bytes" in caplog.text


def test_a_loaded_copy_is_complete_only_with_its_published_manifest(tmp_path, version):
    sd = shard(5)
    store = Store.open(tmp_path, TOKEN)
    into = store.allocate_like("m", 2, sd)
    for name, t in sd.items():
        into[name].copy_(t)
    manifest, _ = lay_out(into, chunk_bytes=1 << 19)
    store.complete("m", 2, shards=[manifest])
    store.close()
    [copy] = Store.open(tmp_path, TOKEN).recover()
    assert (copy.rank, copy.world, copy.shards) == (0, 1, [manifest])
    assert [copy.placed.checksum(c) for c in range(len(manifest.chunks))] == [c.checksum for c in manifest.chunks]


def test_one_store_one_live_agent_and_no_files_while_it_holds_no_copy(tmp_path):
    root = tmp_path / "c" / "agent-n1"
    first = Store.open(root, TOKEN)
    assert first.recover() == [] and not root.exists()
    with pytest.raises(StoreError, match=rf"{root} is in use by another live agent \(pid {os.getpid()}\)"):
        Store.open(root, TOKEN)
    first.close()
    Store.open(root, TOKEN).close()


def test_a_version_is_allocated_once_and_remove_and_clear_delete_files(tmp_path, version):
    manifests, _ = version
    store = Store.open(tmp_path / "c" / "agent-n1", TOKEN)
    store.allocate("m", 1, manifests)
    with pytest.raises(StoreError, match="m@1 is already in the agent store"):
        store.allocate("m", 1, manifests)
    store.allocate("m", 2, manifests)
    store.remove("m", 1)
    assert not store.path("m", 1).exists() and store.path("m", 2).exists()
    store.allocate("m", 1, manifests)  # removed: may be made again
    store.clear()
    assert not (tmp_path / "c").exists()


def test_a_full_store_is_an_error_naming_it_and_leaves_nothing(tmp_path, version, monkeypatch):
    manifests, _ = version
    store = Store.open(tmp_path, TOKEN)

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    with pytest.raises(StoreError, match=r"cannot store m@1 \(\d+ bytes\) in .*No space left"):
        store.allocate("m", 1, manifests)
    assert not store.path("m", 1).exists()


def test_agent_dir_names(tmp_path, monkeypatch):
    monkeypatch.delenv("TH_AGENT_STORE", raising=False)
    assert agent_dir("agent-n1", "tcp://10.0.0.1:7790") == agent_dir("agent-n1", "tcp://x:7790", base=None)
    assert str(agent_dir("agent-n1", "tcp://10.0.0.1:7790")).endswith("/hub-7790/agent-n1")
    assert agent_dir("agent-n1", "tcp://h:1", cluster="demo", base=str(tmp_path)) == tmp_path / "demo" / "agent-n1"
    monkeypatch.setenv("TH_AGENT_STORE", str(tmp_path))
    assert agent_dir("agent-n1", "tcp://h:1") == tmp_path / "hub-1" / "agent-n1"
    with pytest.raises(StoreError, match="cluster '../x'"):
        agent_dir("agent-n1", "tcp://h:1", cluster="../x")
    with pytest.raises(StoreError, match="has no port"):
        agent_dir("agent-n1", "ipc:///tmp/hub")


class FakeAgent:
    """What ``AgentCommands`` uses of the agent's endpoint: a fetch that fills the
    destination ``into`` makes (or fails), a publish that lays the state_dict out."""

    name = "agent-n1"

    def __init__(self, version, fail: bool = False):
        self.manifests, self.want = version
        self.fail = fail
        self.held: dict = {}
        self.reports: list = []
        self.last_fetch = {"bytes": 1}
        self.sync_into: dict = {}

    def fetch(self, model, version, *, into, timeout):
        dst = into(self.manifests)
        if self.fail:
            raise RuntimeError("no holder answered")
        for name, t in self.want.items():
            dst[name].copy_(t)
        self.held[(model, version)] = dst
        return version

    def publish(self, model, version, state_dict, *, chunk_bytes, timeout):
        self.held[(model, version)] = state_dict
        return lay_out(state_dict, chunk_bytes or (1 << 19))[0]

    def discard(self, model, version):
        self.held.pop((model, version), None)

    info = p.EndpointInfo(name="agent-n1", node="n1", role="agent", kind="agent")
    drain_timeout_s = 1.0

    def unpublish(self, model, version, *, timeout):
        self.held.pop((model, version))

    def holdings(self):
        return [p.Holding(model=m, version=v, world=1, shards=[]) for m, v in self.held]

    def report(self, cmd, kind, message="", *, timeout=None):
        self.reports.append(kind)


def test_agent_commands_keep_retained_copies_in_the_store_until_discarded(tmp_path, version):
    store = Store.open(tmp_path, TOKEN)
    ep, commands = FakeAgent(version), AgentCommands(store)
    commands(ep, p.Command(action="retain", model="m", version=1))
    assert ep.reports == ["retained"] and (store.path("m", 1) / "complete").exists()
    assert (store.path("m", 1) / "data").stat().st_size >= sum(t.nbytes for t in version[1].values())
    commands(ep, p.Command(action="discard", model="m", version=1))
    assert ep.held == {} and not store.path("m", 1).exists()


def test_an_operators_unpublish_drains_the_copy_and_deletes_its_files(tmp_path, version):
    """`th unpublish`: a restarted agent must not offer a withdrawn version again."""
    store = Store.open(tmp_path, TOKEN)
    ep, commands = FakeAgent(version), AgentCommands(store)
    commands(ep, p.Command(action="retain", model="m", version=1))
    assert (store.path("m", 1) / "complete").exists()
    commands(ep, p.Command(action="unpublish", model="m", version=1))
    assert ep.held == {} and not store.path("m", 1).exists()
    assert store.recover() == []


def test_a_failed_retain_leaves_no_files(tmp_path, version):
    store = Store.open(tmp_path, TOKEN)
    ep = FakeAgent(version, fail=True)
    AgentCommands(store)(ep, p.Command(action="retain", model="m", version=1))
    assert ep.reports == ["retain_failed"] and not store.path("m", 1).exists()


def test_a_loaded_checkpoint_is_stored_and_re_adopted_as_published(tmp_path, version):
    from safetensors.torch import save_file

    sd = shard(7)
    save_file(sd, str(tmp_path / "ckpt.safetensors"))
    store = Store.open(tmp_path / "store", TOKEN)
    ep = FakeAgent(version)
    AgentCommands(store)(ep, p.Command(action="load", model="m", version=4, path=str(tmp_path / "ckpt.safetensors")))
    assert ep.reports == ["loaded"]
    store.close()
    [copy] = Store.open(tmp_path / "store", TOKEN).recover()
    assert (copy.model, copy.version, copy.rank) == ("m", 4, 0)
    assert all(torch.equal(copy.tensors[k], v) for k, v in sd.items())


def test_a_full_store_falls_back_to_process_memory(tmp_path, version, monkeypatch, caplog):
    store = Store.open(tmp_path, TOKEN)
    monkeypatch.setattr("os.posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    ep = FakeAgent(version)
    AgentCommands(store)(ep, p.Command(action="retain", model="m", version=1))
    assert ep.reports == ["retained"] and not store.path("m", 1).exists()
    assert "m@1 held in process memory, lost if the agent dies" in caplog.text


def test_a_re_adopted_copy_the_hub_did_not_take_is_dropped(tmp_path, version, caplog):
    from tensorhub_cli.agent.daemon import confirm

    stored(tmp_path, version)
    store = Store.open(tmp_path, TOKEN)
    [copy] = store.recover()

    class Hub:
        name = "agent-n1"

        def __init__(self, holders):
            self.holders = holders
            self.discarded: list = []

        def versions(self, model, *, timeout):
            return [p.VersionStatus(model=model, version=3, state="READY", chunks=1, nbytes=1, replicas=1,
                                    complete_replicas=1, holders=self.holders)]

        def discard(self, model, version):
            self.discarded.append((model, version))

    took = Hub([p.HolderStatus(name="agent-n1", held_bytes=1, complete=True, reliable=True)])
    confirm(took, store, [copy], 1.0)
    assert store.path("org/m", 3).exists() and not took.discarded
    refused = Hub([p.HolderStatus(name="pub", held_bytes=1, complete=True, reliable=True)])
    confirm(refused, store, [copy], 1.0)
    assert refused.discarded == [("org/m", 3)] and not store.path("org/m", 3).exists()
    assert "dropped re-adopted copy org/m@3: the hub did not take it" in caplog.text
