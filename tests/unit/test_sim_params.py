"""The simulator's YAML: the documented defaults are the defaults, and bad input names its field."""

import pytest

from tensorhub_cli.sim.params import DEFAULT_FILE, ParamsError, SimParams, load


def test_specs_sim_yaml_documents_exactly_the_defaults():
    assert load(DEFAULT_FILE) == SimParams()


def test_a_partial_file_keeps_the_other_defaults(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("cluster:\n  gpus: 64\nroles:\n  rollout_tp: 4\n")
    p = load(f)
    assert (p.cluster.gpus, p.roles.rollout_tp, p.cluster.nic_gbps) == (64, 4, SimParams().cluster.nic_gbps)


@pytest.mark.parametrize("text, field", [
    ("cluster:\n  nic_gbps: 0\n", "cluster.nic_gbps"),
    ("cluster:\n  nic_gpbs: 100\n", "cluster.nic_gpbs"),  # a typo is an error, not a default
    ("hub:\n  heartbeat_s: 4\n  expiry_s: 5\n", "hub"),
    ("curves:\n  rollout_gpus: [8, 0]\n", "curves"),
    ("deltas:\n  ratio: 0\n", "deltas.ratio"),
    ("deltas:\n  ratio: 1.5\n", "deltas.ratio"),
    ("deltas:\n  rebuild_gbps: 0\n", "deltas.rebuild_gbps"),
    ("deltas:\n  levels: [wan]\n", "deltas.levels"),
    ("deltas:\n  enable: true\n", "deltas.enable"),  # a typo is an error, not a default
    ("roles:\n  export: all\n", "roles.export"),
])
def test_a_bad_field_is_named(tmp_path, text, field):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(ParamsError) as err:
        load(f)
    assert any(f": {field}" in line for line in err.value.lines), err.value.lines


def test_not_a_mapping(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ParamsError, match="mapping"):
        load(f)
