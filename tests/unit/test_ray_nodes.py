"""``launcher: ray`` specs: what the spec checks ask of them, and how Ray's nodes become
the running spec's (``launch.ray_nodes``: pure, fed ``ray.nodes()``-shaped entries)."""

from __future__ import annotations

import copy

import pytest
import yaml

from tensorhub_cli.launch.ray_follow import _with, _without, write_spec
from tensorhub_cli.launch.ray_nodes import RAY_NODE_ID, RayNodesError, node_of, resolve
from tensorhub_cli.spec import SpecError, load

from ..conftest import REPO

RAY = yaml.safe_load((REPO / "specs" / "ray.yaml").read_text())
LOCAL = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())


def spec_of(tmp_path, doc):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load(path)


def problems(tmp_path, doc) -> list[str]:
    with pytest.raises(SpecError) as err:
        spec_of(tmp_path, doc)
    return err.value.lines


def ray_node(node_id, address, head=False, alive=True, labels=None, resources=None):
    res = {"CPU": 1.0, **(resources or {})}
    if head:
        res["node:__internal_head__"] = 1.0
    return {"NodeID": node_id, "Alive": alive, "NodeManagerAddress": address, "Resources": res,
            "Labels": labels or {}}


def test_a_ray_spec_needs_no_topology_nor_hub_node(tmp_path):
    spec = spec_of(tmp_path, RAY)
    assert spec.launcher == "ray" and spec.topology is None and spec.hub.node is None and spec.nodes() == []


def test_other_launchers_still_need_topology_and_hub_node_and_no_ray_section(tmp_path):
    doc = copy.deepcopy(LOCAL)
    del doc["topology"], doc["hub"]["node"], doc["roles"]
    doc["ray"] = {"address": "auto"}
    lines = problems(tmp_path, doc)
    assert any(ln.startswith("topology: required with launcher 'local'") for ln in lines), lines
    assert any(ln.startswith("hub.node: required with launcher 'local'") for ln in lines), lines
    assert any(ln.startswith("ray: only for launcher 'ray'") for ln in lines), lines


def test_ray_nodes_are_named_and_placed_by_labels_resources_and_overrides(tmp_path):
    doc = copy.deepcopy(RAY)
    doc["topology"] = {"datacenters": [{"name": "west", "racks": [{"name": "r9", "nodes": [
        {"name": "trainer-node", "address": "10.0.0.3", "labels": {"tier": "train"}}]}]}]}
    given = spec_of(tmp_path, doc)
    spec = resolve(given, [
        ray_node("b" * 8, "10.0.0.2", resources={"tensorhub.io/rack=r2": 1.0, "GPU": 2.0}),
        ray_node("a" * 8, "10.0.0.1", head=True, labels={"tensorhub.io/node": "head", "tensorhub.io/dc": "east"}),
        ray_node("c" * 8, "10.0.0.3"),
        ray_node("d" * 8, "10.0.0.4", alive=False),
    ])
    placed = {n.name: (n.spec.address, n.rack, n.dc, n.spec.gpus) for n in spec.nodes()}
    assert placed == {"head": ("10.0.0.1", "rack0", "east", 0), "ray-10-0-0-2": ("10.0.0.2", "r2", "dc0", 2),
                      "trainer-node": ("10.0.0.3", "r9", "west", 0)}
    assert spec.hub.node == "head"  # the Ray head, when hub.node is not given
    assert spec.node("trainer-node").spec.labels == {"tier": "train", RAY_NODE_ID: "c" * 8}
    assert node_of(spec, "b" * 8).name == "ray-10-0-0-2" and node_of(spec, "d" * 8) is None
    # what th up writes as the running spec loads back as it was
    write_spec(spec, tmp_path / "running.yaml")
    assert load(tmp_path / "running.yaml") == spec


def test_hub_node_by_address_and_errors_name_the_fault(tmp_path):
    doc = copy.deepcopy(RAY)
    doc["hub"]["node"] = "10.0.0.2"
    given = spec_of(tmp_path, doc)
    nodes = [ray_node("a1", "10.0.0.1", head=True), ray_node("b1", "10.0.0.2")]
    assert resolve(given, nodes).hub.node == "ray-10-0-0-2"
    doc["hub"]["node"] = "10.9.9.9"
    with pytest.raises(RayNodesError, match=r"hub.node: '10.9.9.9' is no live Ray node"):
        resolve(spec_of(tmp_path, doc), nodes)
    with pytest.raises(RayNodesError, match="share the address 10.0.0.1"):
        resolve(given, [ray_node("a1", "10.0.0.1", head=True), ray_node("a2", "10.0.0.1")])
    with pytest.raises(RayNodesError, match="no live node"):
        resolve(given, [ray_node("a1", "10.0.0.1", alive=False)])


def test_a_joined_node_is_added_and_a_left_one_dropped(tmp_path):
    given = spec_of(tmp_path, RAY)
    spec = resolve(given, [ray_node("a1", "10.0.0.1", head=True)])
    later = resolve(given, [ray_node("a1", "10.0.0.1", head=True),
                            ray_node("b1", "10.0.0.2", labels={"tensorhub.io/rack": "r2"})])
    grown = _with(spec, [later.node("ray-10-0-0-2")])
    assert [(n.name, n.rack) for n in grown.nodes()] == [("ray-10-0-0-1", "rack0"), ("ray-10-0-0-2", "r2")]
    assert [n.name for n in _without(grown, "ray-10-0-0-2").nodes()] == ["ray-10-0-0-1"]


def test_an_address_no_ray_head_answers_at_fails_at_once_naming_it():
    """ray.init retries an unreachable GCS for minutes; `th up` says so within seconds."""
    pytest.importorskip("ray")
    from tensorhub_cli.launch.ray_launcher import RayLauncherError, join

    from ..conftest import free_port

    port = free_port()  # (nothing listens there once the probe socket is closed)
    with pytest.raises(RayLauncherError, match=rf"ray.address '127.0.0.1:{port}': no Ray head answers there"):
        join(f"127.0.0.1:{port}", "tensorhub", timeout=2.0)
