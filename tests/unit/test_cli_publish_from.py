"""`th publish --from HF_DIR`: on a local cluster the directory is checked here, and a
bad one is one line naming the path, exit 2, before anything reaches the hub; a good
one (and a safetensors file, as before) goes to the node's agent as its resolved path.

The cluster is a recorded one (state, token, spec copy) whose hub every test replaces:
``HubClient.call`` and the two operations `th publish` sends are recorded instead.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from tensorhub_cli.cli import app
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient
from tensorhub_cli.launch import operate
from tensorhub_cli.launch.state import ClusterState, cluster_dir, write_state, write_token

from ..conftest import REPO

runner = CliRunner()


@pytest.fixture
def sent(th_home, monkeypatch) -> list:
    """A recorded local cluster 'demo'; what `th publish` would have sent to its hub."""
    write_state(ClusterState(cluster="demo", launcher="local", hub_address="tcp://127.0.0.1:9",
                             hub_node_address="127.0.0.11", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0))
    write_token("demo", "t" * 32)
    shutil.copyfile(REPO / "specs" / "local.yaml", cluster_dir("demo") / "spec.yaml")
    calls: list = []

    def call(self, op, timeout=None):
        calls.append(op)
        raise AssertionError(f"sent to the hub: {op!r}")

    def publish_file(client, node, model, path, version, chunk_bytes, timeout, **kw):
        calls.append(("publish_file", node, model, path, version))
        return p.VersionStatus(model=model, version=version, state="READY", nbytes=2**20, chunks=1, replicas=1,
                               complete_replicas=1)

    monkeypatch.setattr(HubClient, "call", call)
    monkeypatch.setattr(operate, "next_version", lambda client, model: calls.append(("next_version", model)) or 1)
    monkeypatch.setattr(operate, "publish_file", publish_file)
    return calls


@pytest.fixture
def hf_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    path = tmp_path / "ckpt"
    model.save_pretrained(path, max_shard_size="20KB")
    return path


def publish(source) -> tuple[int, str]:
    result = runner.invoke(app, ["publish", "policy", "--from", str(source), "--node", "node2"])
    return result.exit_code, result.output


def test_a_sharded_hf_directory_goes_to_the_agent_as_its_resolved_path(sent, hf_dir, monkeypatch):
    monkeypatch.chdir(hf_dir.parent)
    code, output = publish("ckpt")
    assert code == 0, output
    assert sent == [("next_version", "policy"), ("publish_file", "node2", "policy", str(hf_dir.resolve()), 1)]
    assert "published policy@1 from ckpt on node2" in output


def test_a_safetensors_file_still_goes_as_before(sent, tmp_path):
    save_file({"w": torch.ones(3)}, str(tmp_path / "w.safetensors"))
    code, output = publish(tmp_path / "w.safetensors")
    assert code == 0, output
    assert sent[-1] == ("publish_file", "node2", "policy", str(tmp_path / "w.safetensors"), 1)


def one_line(output: str) -> str:
    return " ".join(output.split())  # (rich wraps long lines at the terminal's width)


@pytest.mark.parametrize("case, needle", [
    ("no such path", "ckpt: no such file or directory"),
    ("no index, no model.safetensors", "ckpt: neither model.safetensors.index.json (a sharded checkpoint) nor "
                                       "model.safetensors is in this directory"),
    ("a shard missing", "ckpt: shard model-00002-of-"),
    ("a tensor missing from its shard", "is not in this shard, though model.safetensors.index.json maps it there"),
    ("a broken index", "model.safetensors.index.json: not an index with a weight_map"),
    ("a shard outside the directory", "is not a file name in the directory"),
])
def test_a_bad_directory_is_one_line_naming_the_path_and_nothing_is_sent(sent, hf_dir, case, needle):
    index = hf_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    if case == "no such path":
        shutil.rmtree(hf_dir)
    elif case == "no index, no model.safetensors":
        index.unlink()
    elif case == "a shard missing":
        (hf_dir / sorted(set(weight_map.values()))[1]).unlink()
    elif case == "a tensor missing from its shard":
        save_file({"x": torch.zeros(1)}, str(hf_dir / sorted(set(weight_map.values()))[0]))
    elif case == "a broken index":
        index.write_text("{")
    else:
        index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "../elsewhere.safetensors"}}))
    code, output = publish(hf_dir)
    assert code == 2, output
    assert sent == []
    line = one_line(output)
    assert line.startswith(f"th publish: --from {hf_dir}") and needle in line, output
