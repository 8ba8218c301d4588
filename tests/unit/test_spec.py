"""Spec validation: every problem is exit 2 with the offending field named."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from typer.testing import CliRunner

from tensorhub_cli.cli import app
from tensorhub_cli.spec import load, select_nodes

from ..conftest import REPO

runner = CliRunner()

BASE = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())


def nodes(doc):
    return doc["topology"]["datacenters"][0]["racks"][0]["nodes"]


def check(tmp_path, doc_or_text):
    path = tmp_path / "spec.yaml"
    path.write_text(doc_or_text if isinstance(doc_or_text, str) else yaml.safe_dump(doc_or_text, sort_keys=False))
    return runner.invoke(app, ["spec", "check", str(path)])


def set_in(doc, path, value):
    *head, last = path
    for key in head:
        doc = doc[key]
    doc[last] = value


def delete(doc, path):
    *head, last = path
    for key in head:
        doc = doc[key]
    del doc[last]


N0 = ("topology", "datacenters", 0, "racks", 0, "nodes", 0)
N1 = ("topology", "datacenters", 0, "racks", 0, "nodes", 1)

# (id, mutation, field path expected at the start of a line, words expected in the message)
BAD = [
    ("missing-name", lambda d: delete(d, ("name",)), "name", "required"),
    ("bad-name-chars", lambda d: set_in(d, ("name",), "my cluster!"), "name", "pattern"),
    ("unknown-top-key", lambda d: set_in(d, ("luancher",), "local"), "luancher", "unknown key"),
    ("unknown-node-key", lambda d: set_in(d, N0 + ("gpuz",), 1), "topology.datacenters[0].racks[0].nodes[0].gpuz", "unknown key"),
    ("launcher-value", lambda d: set_in(d, ("launcher",), "kubernetes"), "launcher", "'local', 'ssh' or 'ray'"),
    ("engine-value", lambda d: set_in(d, ("engine",), "rdma"), "engine", "'nixl' or 'tcp'"),
    ("hub-port-high", lambda d: set_in(d, ("hub", "port"), 70000), "hub.port", "65535"),
    ("hub-port-zero", lambda d: set_in(d, ("hub", "port"), 0), "hub.port", "greater than or equal to 1"),
    ("metrics-port-high", lambda d: set_in(d, ("hub", "metrics_port"), 99999), "hub.metrics_port", "65535"),
    ("metrics-equals-hub", lambda d: set_in(d, ("hub", "metrics_port"), d["hub"]["port"]), "hub.metrics_port", "differ"),
    ("hub-unknown-node", lambda d: set_in(d, ("hub", "node"), "node9"), "hub.node", "unknown node 'node9'"),
    ("hub-missing", lambda d: delete(d, ("hub",)), "hub", "required"),
    ("expiry-short", lambda d: set_in(d, ("hub", "expiry_s"), 0.6), "hub", "twice heartbeat_s"),
    ("muster-negative", lambda d: set_in(d, ("hub", "muster_s"), -0.1), "hub.muster_s", "greater than or equal to 0"),
    ("dup-node-name", lambda d: set_in(d, N1 + ("name",), "node1"), "topology.datacenters[0].racks[0].nodes[1].name", "duplicate node name"),
    ("dup-node-address", lambda d: set_in(d, N1 + ("address",), "127.0.0.11"), "topology.datacenters[0].racks[0].nodes[1].address", "duplicate node address"),
    ("not-loopback", lambda d: set_in(d, N0 + ("address",), "10.0.0.1"), "topology.datacenters[0].racks[0].nodes[0].address", "loopback"),
    ("gpus-negative", lambda d: set_in(d, N0 + ("gpus",), -1), "topology.datacenters[0].racks[0].nodes[0].gpus", "greater than or equal to 0"),
    ("nic-zero", lambda d: set_in(d, N0 + ("nic_gbps",), 0), "topology.datacenters[0].racks[0].nodes[0].nic_gbps", "greater than 0"),
    ("spot-not-bool", lambda d: set_in(d, N0 + ("spot",), "sometimes"), "topology.datacenters[0].racks[0].nodes[0].spot", "boolean"),
    ("no-racks", lambda d: set_in(d, ("topology", "datacenters", 0, "racks"), []), "topology.datacenters[0].racks", "at least 1"),
    ("link-unknown-dc", lambda d: set_in(d, ("topology", "links"), [{"between": ["dc1", "mars"], "gbps": 1}]), "topology.links[0].between", "unknown datacenter 'mars'"),
    ("link-self", lambda d: set_in(d, ("topology", "links"), [{"between": ["dc1", "dc1"], "gbps": 1}]), "topology.links[0].between", "two different"),
    ("link-gbps-zero", lambda d: set_in(d, ("topology", "links"), [{"between": ["dc1", "dc2"], "gbps": 0}]), "topology.links[0].gbps", "greater than 0"),
    ("role-unknown-node", lambda d: set_in(d, ("roles", "rollout", "select", "nodes"), ["node2", "ghost"]), "roles.rollout.select.nodes[1]", "unknown node 'ghost'"),
    ("group-not-dividing", lambda d: (set_in(d, ("roles", "rollout", "count"), 2), set_in(d, ("roles", "rollout", "group_size"), 3)), "roles.rollout.group_size", "does not divide count 2"),
    ("role-count-negative", lambda d: set_in(d, ("roles", "rollout", "count"), -2), "roles.rollout.count", "greater than or equal to 0"),
    ("role-selects-nothing", lambda d: (set_in(d, ("roles", "trainer", "count"), 1), set_in(d, ("roles", "trainer", "select"), {"labels": {"tier": "none"}})), "roles.trainer.select", "selects no node"),
    ("role-unknown-key", lambda d: set_in(d, ("roles", "trainer", "replicas"), 2), "roles.trainer.replicas", "unknown key"),
    ("chunk-zero", lambda d: set_in(d, ("models", 0, "chunk_mb"), 0), "models[0].chunk_mb", "greater than 0"),
    ("chunk-negative", lambda d: set_in(d, ("models", 0, "chunk_mb"), -4), "models[0].chunk_mb", "greater than 0"),
    ("min-copies-negative", lambda d: set_in(d, ("models", 0, "retain", "min_reliable_copies"), -1), "models[0].retain.min_reliable_copies", "greater than or equal to 0"),
    ("keep-latest-zero", lambda d: set_in(d, ("models", 0, "retain", "keep_latest"), 0), "models[0].retain.keep_latest", "greater than or equal to 1"),
    ("deltas-unknown", lambda d: set_in(d, ("models", 0, "deltas"), "wan"), "models[0].deltas", "'off', 'remote' or 'all'"),
    ("dup-model", lambda d: d["models"].append(copy.deepcopy(d["models"][0])), "models[1].name", "duplicate model name"),
    ("token-and-file", lambda d: set_in(d, ("auth",), {"token": "x" * 20, "token_file": "t"}), "auth", "not both"),
    ("token-short", lambda d: set_in(d, ("auth",), {"token": "short"}), "auth.token", "at least 16"),
    ("token-file-missing", lambda d: set_in(d, ("auth",), {"token_file": "nope.token"}), "auth.token_file", "no such file"),
    ("ssh-port", lambda d: set_in(d, ("ssh",), {"port": 123456}), "ssh.port", "65535"),
    ("node-ssh-override-key", lambda d: set_in(d, N0 + ("ssh",), {"usr": "root"}), "topology.datacenters[0].racks[0].nodes[0].ssh.usr", "unknown key"),
    ("bootstrap-key", lambda d: set_in(d, N0 + ("bootstrap",), {"venv": "/x"}), "topology.datacenters[0].racks[0].nodes[0].bootstrap.venv", "unknown key"),
    ("read-timeout-zero", lambda d: set_in(d, ("endpoints",), {"read_timeout_s": 0}), "endpoints.read_timeout_s", "greater than 0"),
    ("plan-timeout-high", lambda d: set_in(d, ("endpoints",), {"plan_timeout_s": 10**6}), "endpoints.plan_timeout_s", "less than or equal to"),
    ("drain-timeout-negative", lambda d: set_in(d, ("endpoints",), {"drain_timeout_s": -1}), "endpoints.drain_timeout_s", "greater than 0"),
    ("drain-timeout-text", lambda d: set_in(d, ("endpoints",), {"drain_timeout_s": "long"}), "endpoints.drain_timeout_s", "number"),
    ("endpoints-unknown-key", lambda d: set_in(d, ("endpoints",), {"read_timeout": 5}), "endpoints.read_timeout", "unknown key"),
    ("ucx-devices-not-one-per-gpu", lambda d: (set_in(d, N0 + ("gpus",), 2), set_in(d, N0 + ("ucx_net_devices",), ["mlx5_0:1"])), "topology.datacenters[0].racks[0].nodes[0].ucx_net_devices", "lists 1 entries, one per GPU, but the node has gpus: 2"),
    ("ucx-devices-bad-name", lambda d: set_in(d, N0 + ("ucx_net_devices",), "mlx5_0:1;mlx5_1:1"), "topology.datacenters[0].racks[0].nodes[0].ucx_net_devices", "is not a UCX device list"),
    ("ucx-devices-bad-entry", lambda d: (set_in(d, N0 + ("gpus",), 2), set_in(d, N0 + ("ucx_net_devices",), ["mlx5_0:1", 7])), "topology.datacenters[0].racks[0].nodes[0].ucx_net_devices", "entry 1: 7 is not"),
    ("ucx-devices-number", lambda d: set_in(d, N0 + ("ucx_net_devices",), 5), "topology.datacenters[0].racks[0].nodes[0].ucx_net_devices", "takes a UCX device list"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_spec_names_the_field(tmp_path, case):
    _, mutate, field, words = case
    doc = copy.deepcopy(BASE)
    mutate(doc)
    result = check(tmp_path, doc)
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    hits = [ln for ln in lines if ln.startswith(field + ":") or ln.startswith(field + "[") or ln.startswith(field + ".")]
    assert hits, f"no line names {field!r}:\n{result.output}"
    assert any(words in ln for ln in hits), f"{words!r} not in:\n{result.output}"


def test_enough_distinct_bad_specs():
    assert len({c[0] for c in BAD}) >= 25
    assert len({c[2] for c in BAD}) >= 25


def test_line_numbers_point_at_the_field(tmp_path):
    text = (REPO / "specs" / "local.yaml").read_text().replace("port: 7700", "port: 77000")
    result = check(tmp_path, text)
    want = next(i for i, ln in enumerate(text.splitlines(), 1) if "port: 77000" in ln)
    assert result.exit_code == 2
    assert f"hub.port: Input should be less than or equal to 65535 (line {want})" in result.output


def test_every_problem_reported_at_once(tmp_path):
    doc = copy.deepcopy(BASE)
    set_in(doc, ("hub", "node"), "nowhere")
    set_in(doc, N1 + ("name",), "node1")
    result = check(tmp_path, doc)
    assert result.exit_code == 2
    assert "hub.node:" in result.output and "nodes[1].name:" in result.output


@pytest.mark.parametrize(
    "text,words",
    [("name: [unclosed\n", "YAML does not parse"), ("- just\n- a list\n", "must be a YAML mapping"),
     ("", "the file is empty"), ("# only a comment\n", "the file is empty"),
     ("name: " + "[" * 1000 + "]" * 1000 + "\n", "nests deeper than 32 levels (line 1)"),
     ("".join("  " * i + "a:\n" for i in range(1000)) + "  " * 1000 + "b: 1\n", "nests deeper than 32 levels (line 33)")],
    ids=["unclosed", "list", "empty", "comment-only", "1000-deep-flow", "1000-deep-block"],
)
def test_unparseable_yaml_is_one_line(tmp_path, text, words):
    result = check(tmp_path, text)
    assert result.exit_code == 2
    assert words in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert "NoneType" not in result.output and "got list" not in result.output  # words, not Python type names


@pytest.mark.parametrize("command", [["spec", "check"], ["up"]])
def test_on_in_a_role_is_one_line_with_the_select_hint(tmp_path, th_home, command):
    text = (REPO / "specs" / "local.yaml").read_text().replace("select: {nodes: [node2, node3]}", "on: [node2, node3]")
    want = next(i for i, ln in enumerate(text.splitlines(), 1) if "on: [node2" in ln)
    (tmp_path / "spec.yaml").write_text(text)
    result = runner.invoke(app, [*command, str(tmp_path / "spec.yaml")])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        "roles.rollout.on: YAML 1.1 reads `on` as true; a role picks its nodes with "
        f"`select: {{nodes: [...], labels: {{...}}}}` (line {want})"], result.output
    assert not th_home.exists() or not any(th_home.iterdir())  # `th up` started nothing


def test_any_key_yaml_reads_as_a_boolean_is_named_as_written(tmp_path):
    text = (REPO / "specs" / "local.yaml").read_text().replace("labels: {tier: train}", "labels: {Yes: train}")
    result = check(tmp_path, text)
    assert result.exit_code == 2
    assert result.output.startswith("topology.datacenters[0].racks[0].nodes[0].labels.Yes: YAML 1.1 reads the key "
                                    "'Yes' as true/false; quote it"), result.output
    quoted = check(tmp_path, text.replace("{Yes: train}", "{'Yes': train}"))
    assert quoted.exit_code == 0, quoted.output


def test_missing_file_is_one_line(tmp_path):
    result = runner.invoke(app, ["spec", "check", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2
    assert result.output.strip().endswith("absent.yaml: no such file")


@pytest.mark.parametrize("name", ["local", "testbed-8", "two-dc", "rl-standalone", "rl-elastic"])
def test_example_specs_pass(name):
    result = runner.invoke(app, ["spec", "check", str(REPO / "specs" / f"{name}.yaml")])
    assert result.exit_code == 0, result.output


def test_example_shapes():
    local, tb, two = (load(REPO / "specs" / f"{n}.yaml") for n in ("local", "testbed-8", "two-dc"))
    assert local.launcher == "local" and len(local.nodes()) >= 3
    assert all(n.spec.address.startswith("127.") for n in local.nodes())
    assert tb.launcher == "ssh" and len(tb.nodes()) == 8 and len({n.rack for n in tb.nodes()}) == 2
    assert len(two.topology.datacenters) == 2 and two.topology.links[0].gbps < min(n.spec.nic_gbps for n in two.nodes())


def test_selectors_and_ssh_overrides(tmp_path):
    tb = load(REPO / "specs" / "testbed-8.yaml")
    assert select_nodes(tb, "trainer") == ["n1"]
    doc = yaml.safe_load((REPO / "specs" / "testbed-8.yaml").read_text())
    doc["topology"]["datacenters"][0]["racks"][0]["nodes"][1]["ssh"] = {"port": 2222, "user": "ops"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    s = load(tmp_path / "s.yaml")
    n2 = s.node("n2").spec
    merged = s.ssh_for(n2)
    assert (merged.port, merged.user, merged.strict_host_keys) == (2222, "ops", True)
    assert s.ssh_for(s.node("n3").spec).port == 22


def test_schema_is_json_and_forbids_extras():
    result = runner.invoke(app, ["spec", "schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["additionalProperties"] is False
    # topology is required by the launchers that start on listed nodes (a cross-field
    # check), not by the schema: launcher 'ray' takes its nodes from Ray
    assert {"hub", "name"} <= set(schema["required"]) and "topology" in schema["properties"]
    endpoints = schema["$defs"]["EndpointsSpec"]["properties"]
    assert {"read_timeout_s", "plan_timeout_s", "drain_timeout_s"} <= set(endpoints)
    assert all(f.get("description") for f in endpoints.values())


def test_endpoints_defaults_and_override(tmp_path):
    assert load(REPO / "specs" / "local.yaml").endpoints.model_dump() == {
        "read_timeout_s": 30.0,
        "plan_timeout_s": 5.0,
        "drain_timeout_s": 120.0,
    }
    doc = copy.deepcopy(BASE)
    doc["endpoints"] = {"drain_timeout_s": 7.5}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    s = load(tmp_path / "s.yaml")
    assert (s.endpoints.drain_timeout_s, s.endpoints.read_timeout_s) == (7.5, 30.0)


def test_ucx_net_devices_per_node_or_per_gpu(tmp_path):
    doc = copy.deepcopy(BASE)
    set_in(doc, N0 + ("gpus",), 2)
    set_in(doc, N0 + ("ucx_net_devices",), ["mlx5_0:1", "mlx5_1:1,mlx5_2:1"])
    set_in(doc, N1 + ("ucx_net_devices",), "mlx5_0:1")
    result = check(tmp_path, doc)
    assert result.exit_code == 0, result.output
    s = load(tmp_path / "spec.yaml")
    assert s.node("node1").spec.ucx_net_devices == ["mlx5_0:1", "mlx5_1:1,mlx5_2:1"]
    assert s.node("node2").spec.ucx_net_devices == "mlx5_0:1"
    assert s.node("node3").spec.ucx_net_devices is None
    schema = json.loads(runner.invoke(app, ["spec", "schema"]).output)
    assert "one entry per GPU" in schema["$defs"]["NodeSpec"]["properties"]["ucx_net_devices"]["description"]


MANY_PROBLEMS = """\
name: demo
launcher: local
hub: {node: node9, port: 7700}
topology:
  datacenters:
    - name: dc1
      racks:
        - name: rack1
          nodes:
            - {name: node1, address: 127.0.0.11, gpus: -1}
            - {name: node2, address: 10.0.0.2}
            - {name: node3, address: 127.0.0.13}
roles:
  trainer:
    count: 1
    on: [node1]
  rollout:
    count: 3
    group_size: 2
    select: {nodes: [node1, node7]}
models:
  - {name: policy, chunk_mb: -1}
"""


def test_every_problem_of_a_spec_at_once_boolean_keys_fields_and_cross_checks(tmp_path):
    """An `on:` key, bad fields and cross-field problems: all in one run, in line order
    (issue 31: they used to appear one fix at a time: `on:`, then the fields, then the rest)."""
    result = check(tmp_path, MANY_PROBLEMS)
    assert result.exit_code == 2
    node = "topology.datacenters[0].racks[0].nodes"
    assert result.output.splitlines() == [
        "hub.node: unknown node 'node9' (line 3)",
        f"{node}[0].gpus: Input should be greater than or equal to 0 (line 10)",
        # node1 (bad) was set aside for the cross-checks: node2 keeps its own index
        f"{node}[1].address: launcher 'local' needs a loopback IP (127.x.y.z), got '10.0.0.2' (line 11)",
        "roles.trainer.on: YAML 1.1 reads `on` as true; a role picks its nodes with "
        "`select: {nodes: [...], labels: {...}}` (line 16)",
        "roles.rollout.group_size: group_size 2 does not divide count 3 (line 19)",
        # not "selects no node": it selects node1, which was only set aside
        "roles.rollout.select.nodes[1]: unknown node 'node7' (line 20)",
        "models[0].chunk_mb: Input should be greater than 0 (line 22)",
    ], result.output


def test_a_bad_part_the_cross_checks_need_leaves_them_for_the_next_run(tmp_path):
    # hub itself is bad (expiry under two beats): the cross-checks cannot run without it,
    # and nothing they would say is invented meanwhile.
    text = MANY_PROBLEMS.replace("hub: {node: node9, port: 7700}", "hub: {node: node9, heartbeat_s: 5, expiry_s: 1}")
    result = check(tmp_path, text)
    assert result.exit_code == 2
    assert "hub: expiry_s must be at least twice heartbeat_s" in result.output
    assert "roles.trainer.on:" in result.output and "nodes[0].gpus:" in result.output
    assert "unknown node" not in result.output
