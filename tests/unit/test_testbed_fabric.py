"""The testbed's shape (scripts/testbed_kit/fabric.py): pure, no root needed."""

from __future__ import annotations

import sys

import pytest

from tensorhub_cli.spec import checks, model

from ..conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from testbed_kit import fabric  # noqa: E402
from testbed_kit.main import _yaml  # noqa: E402


def test_eight_nodes_two_racks_match_the_example_spec():
    f = fabric.build(8, racks=2, node_mbit=500)
    assert [(n.name, n.address, n.rack) for n in f.nodes][:5:4] == [("n1", "10.77.1.1", "rack1"),
                                                                   ("n5", "10.77.2.5", "rack2")]
    assert f.racks == {"rack1": ["n1", "n2", "n3", "n4"], "rack2": ["n5", "n6", "n7", "n8"]}
    kinds = [lk.kind for lk in f.links]
    assert kinds.count("node") == 8 and kinds.count("rack") == 2 and kinds.count("dc") == 0
    assert f.rates_mbit == {"node": 500, "rack": 1000}  # uplink default: twice a node
    assert all(lk.mbit for lk in f.links if lk.kind != "host")  # every link between nodes is shaped


def test_dcs_get_a_core_and_shaped_dc_links():
    f = fabric.build(6, racks=4, dcs=2, node_mbit=1000, dc_mbit=200)
    assert f.dcs == {"dc1": ["rack1", "rack2"], "dc2": ["rack3", "rack4"]}
    dc_links = [lk for lk in f.links if lk.kind == "dc"]
    assert [(lk.a_ns, lk.b_ns, lk.mbit) for lk in dc_links] == [("thtb-dc1", "thtb-core", 200),
                                                               ("thtb-dc2", "thtb-core", 200)]
    assert len({n.address for n in f.nodes}) == 6


@pytest.mark.parametrize("args, field", [((0,), "N"), ((4, 5), "--racks (5)"), ((4, 1, 2), "--racks (1)"),
                                         ((4, 1, 9), "--dcs"), ((4, 1, 1, -1.0), "--node-gbps")])
def test_bad_flags_name_the_flag(args, field):
    with pytest.raises(fabric.FabricError) as exc:
        fabric.build(*args)
    assert str(exc.value).startswith(field)


def test_the_written_cluster_yaml_is_a_valid_spec(tmp_path):
    import yaml

    f = fabric.build(4, racks=2, dcs=2, node_mbit=500, dc_mbit=100)
    doc = fabric.cluster_doc(f, "tb", "/k", "/kh", "/py")
    text = _yaml(doc)
    assert yaml.safe_load(text) == doc  # our stdlib writer round-trips through a real parser
    spec = model.ClusterSpec.model_validate(doc)
    assert checks.cross_check(spec, tmp_path) == []
    assert [(n.name, n.rack, n.dc) for n in spec.nodes()] == [("n1", "rack1", "dc1"), ("n2", "rack1", "dc1"),
                                                              ("n3", "rack2", "dc2"), ("n4", "rack2", "dc2")]
    assert spec.topology.links[0].gbps == 0.1
