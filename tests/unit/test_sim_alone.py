"""``sim.alone``: a simulated run's hub calls, replayed in a process holding only the hub,
reach the run's own hub state and report the CPU of the version's calls."""

import pytest

from tensorhub_cli.sim import alone, curves, workloads
from tensorhub_cli.sim.params import load

SMALL = """
cluster: {gpus: 32, gpus_per_node: 4, nodes_per_rack: 2}
roles: {trainer_fraction: 0.25, rollout_tp: 4}
model: {params: 4.0e+8, chunk_mib: 64}
curves: {rollout_gpus: [4, 8], trainer_gpus: 4}
"""


@pytest.fixture
def params(tmp_path):
    f = tmp_path / "small.yaml"
    f.write_text(SMALL)
    return load(f)


def test_the_replay_takes_the_runs_decisions_and_counts_only_the_versions_calls(params):
    got = workloads.standalone(params, "ros", 4, 16, barrier=False, record=True)
    config, calls, since = got["hub_log"]
    assert 0 < since < len(calls)  # registration and publishing replayed, not counted
    replayed = alone.run(got["hub_log"])
    ran = got["hub_counters"]
    for key in ("plans", "resolves", "chunks_reported", "reads_from_readers"):
        assert replayed["counters"].get(key) == ran.get(key) and ran.get(key), key
    assert 0 < replayed["cpu_s"] < 60
    assert alone.run((config, calls, len(calls)))["cpu_s"] == 0.0  # every call replayed, none counted


def test_scale_rows_carry_the_hub_alone_and_a_run_that_did_not_record_says_so(params):
    row = curves.scale(params, gpus=[16])["rows"][0]
    assert row["hub_cpu_alone_s"] > 0 and 0 < row["hub_busy_alone"] < 1
    # (the requests' modelled 30 us each are in both busy shares)
    assert row["hub_busy_alone"] >= row["hub_calls"] * 0.5 * params.hub.request_overhead_s / row["version_s"]
    got = workloads.standalone(params, "ros", 4, 8, barrier=False)
    assert "hub_log" not in got
    with pytest.raises(RuntimeError, match="did not record"):
        got_world = workloads._world(params, [12], "ros")
        got_world.hub.log(got_world.hub.mark())


def test_a_replay_that_fails_raises_with_the_childs_message():
    with pytest.raises(RuntimeError, match="replaying the hub's calls alone failed"):
        alone.run((None, [(object, 0.0)], 0))
