"""The Hugging Face adapter against a real hub process and real transformers models:
publish by HF names (tied weights once, under the name the loader expects), fetch into
a model's own parameters bit-exact or not at all, read sharded checkpoint directories
as ``save_pretrained`` writes them, and ``th publish --from HF_DIR`` through a node's
agent on a local cluster, fetched back bit-exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tensorhub_cli import connect
from tensorhub_cli.adapters import hf
from tensorhub_cli.agent.commands import AgentCommands
from tensorhub_cli.errors import LayoutError
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)
from .test_local_cluster import cluster, th  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration
SMALL = dict(chunk_bytes=16 << 10, small_bytes=2 << 10, heartbeat_s=0.2, engine="tcp")


def llama(seed: int, tied: bool = True, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def hub(token_file):  # noqa: F811
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    eps = []

    def join(name: str):
        eps.append(connect(hub=address, token=TOKEN, name=name, **SMALL))
        return eps[-1]

    yield join
    for ep in eps:
        ep.close(drain_timeout=0)
    client.close()
    stop_child(proc)


def test_a_tied_model_is_published_once_by_hf_names_and_fetched_in_place_bit_exact(hub):
    source, target = llama(1), llama(2)
    assert not same_weights(source, target)
    manifest = hf.publish(hub("trainer"), "policy", 1, source)
    names = [t.name for t in manifest.tensors]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # save_pretrained's choice
    assert len(names) == len(set(names)) == len(source.state_dict()) - 1
    params = {n: t.data_ptr() for n, t in target.state_dict().items()}
    assert hf.fetch(hub("rollout"), "policy", "latest", target, timeout=30) == 1
    assert same_weights(source, target)
    assert {n: t.data_ptr() for n, t in target.state_dict().items()} == params  # in place
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # still tied


def test_an_untied_state_dict_with_a_non_contiguous_tensor_round_trips(hub):
    sd = llama(3, tied=False).state_dict()
    sd["extra.t"] = torch.randn(24, 40).t()  # a transposed view: published as one contiguous copy
    assert not sd["extra.t"].is_contiguous()
    manifest = hf.publish(hub("trainer"), "policy", 1, sd)
    assert "lm_head.weight" in [t.name for t in manifest.tensors]  # untied: its own tensor
    version, got = hf.fetch_state_dict(hub("rollout"), "policy", 1, timeout=30)
    assert version == 1 and got.keys() == sd.keys()
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_a_model_that_does_not_fit_is_a_layout_error_naming_the_tensor_and_nothing_is_written(hub):
    hf.publish(hub("trainer"), "policy", 1, llama(1))
    other = llama(2, hidden=64)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(LayoutError) as exc:
        hf.fetch(hub("rollout"), "policy", 1, other, timeout=30)
    assert "model.embed_tokens.weight: shape [96, 64], manifest has [96, 32]" in str(exc.value)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_overlapping_tensors_that_are_not_one_are_refused_by_name():
    base = torch.zeros(10)
    with pytest.raises(LayoutError, match="b: overlaps a"):
        hf.distinct({"a": base[:6], "b": base[4:]})
    assert list(hf.distinct({"a": base, "alias": base, "c": torch.ones(2)})) == ["a", "c"]
    assert list(hf.distinct({"e1": torch.empty(0), "e2": torch.empty(0)})) == ["e1", "e2"]  # no bytes: not aliases
    # a tied target listed first still gives way to its source's name
    assert list(hf.distinct({"lm_head.weight": base, "embed.weight": base}, {"lm_head.weight": "embed.weight"})) \
        == ["embed.weight"]


def saved(model, path, shard: str = "40KB"):
    model.save_pretrained(path, max_shard_size=shard)
    return json.loads((path / hf.INDEX).read_text())["weight_map"] if (path / hf.INDEX).exists() else None


def test_read_dir_reads_a_sharded_save_pretrained_checkpoint_memory_mapped(tmp_path):
    model = llama(4)
    weight_map = saved(model, tmp_path / "ckpt")
    assert len(set(weight_map.values())) > 2  # really sharded
    got = hf.read_dir(tmp_path / "ckpt")
    expect = hf.destination(model)
    assert got.keys() == expect.keys() == weight_map.keys()
    assert all(torch.equal(got[k], v) for k, v in expect.items())
    single = tmp_path / "single"
    saved(model, single, shard="10GB")
    assert not (single / hf.INDEX).exists() and (single / hf.SINGLE).exists()
    assert hf.read_dir(single).keys() == expect.keys()


def test_read_dir_names_the_missing_shard_file_or_tensor(tmp_path):
    weight_map = saved(llama(5), tmp_path / "a")
    victim = sorted(set(weight_map.values()))[1]
    (tmp_path / "a" / victim).unlink()
    with pytest.raises(hf.CheckpointError, match=f"shard {victim} is missing"):
        hf.read_dir(tmp_path / "a")
    save_file({"only": torch.zeros(2)}, str(tmp_path / "a" / victim))
    with pytest.raises(hf.CheckpointError, match=f"{victim}: tensor .* is not in this shard"):
        hf.read_dir(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(hf.CheckpointError, match="neither model.safetensors.index.json .* nor model.safetensors"):
        hf.check_dir(tmp_path / "empty")
    with pytest.raises(hf.CheckpointError, match="no such directory"):
        hf.check_dir(tmp_path / "nope")


class Agent:
    """What ``AgentCommands.load`` uses of an endpoint."""

    name = "agent-n1"

    def __init__(self):
        self.published, self.reports = [], []

    def publish(self, model, version, state_dict, *, chunk_bytes, timeout):
        self.published.append(state_dict)

    def report(self, cmd, kind, message="", *, timeout=None):
        self.reports.append((kind, message))


def test_the_agent_loads_an_hf_directory_by_hf_names(tmp_path):
    model = llama(6)
    saved(model, tmp_path / "ckpt")
    ep = Agent()
    AgentCommands()(ep, p.Command(action="load", model="m", version=2, path=str(tmp_path / "ckpt")))
    assert ep.reports == [("loaded", str(tmp_path / "ckpt"))]
    (sd,) = ep.published
    assert sd.keys() == hf.destination(model).keys()
    assert all(torch.equal(sd[k], v) for k, v in hf.destination(model).items())
    (tmp_path / "ckpt" / hf.INDEX).unlink()
    AgentCommands()(ep, p.Command(action="load", model="m", version=3, path=str(tmp_path / "ckpt")))
    assert ep.reports[-1][0] == "load_failed" and "neither model.safetensors.index.json" in ep.reports[-1][1]


def test_th_publish_from_an_hf_directory_then_fetch_it_back_bit_exact(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    model = llama(7)
    weight_map = saved(model, tmp_path / "ckpt")
    assert len(set(weight_map.values())) > 2
    pub = th("publish", "policy", "--from", str(tmp_path / "ckpt"), "--node", "node2", "-c", name, check=True)
    assert "published policy@1" in pub.stdout, pub.stdout
    target = llama(8)
    with connect(cluster=name, node="node3", name="reader", engine="tcp") as ep:
        assert hf.fetch(ep, "policy", "latest", target, timeout=60) == 1
    assert same_weights(model, target)
    versions = json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout)
    assert "agent-node2" in {h["name"] for h in versions[0]["holders"] if h["complete"]}
