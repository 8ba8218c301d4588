"""`th bench sim`'s run(): the JSON it promises, on a cluster small enough for a unit test."""

import json

import pytest

from tensorhub_cli.bench import sim
from tensorhub_cli.sim import curves
from tensorhub_cli.sim.params import load

SMALL = """
cluster: {gpus: 32, gpus_per_node: 4, nodes_per_rack: 2}
roles: {trainer_fraction: 0.25, rollout_tp: 4}
model: {params: 4.0e+8, chunk_mib: 64}
hub: {charge_cpu: false}
curves: {rollout_gpus: [4, 8], trainer_gpus: 4}
"""


@pytest.fixture
def small(tmp_path):
    f = tmp_path / "small.yaml"
    f.write_text(SMALL)
    return f


def test_run_reports_every_promised_key(small, tmp_path):
    measured = tmp_path / "m"
    measured.mkdir()
    result = sim.run(params_file=small, measurements=measured, curves=True, deltas=True)
    json.dumps(result)  # plain data
    assert result["gpus"] == 32 and (result["trainer_gpus"], result["rollout_gpus"]) == (8, 24)
    w = result["workloads"]
    for name, keys in (("standalone", ("ours_stall_s", "baseline_stall_s", "stall_ratio")),
                       ("elastic", ("ours_update_s", "baseline_update_s", "update_ratio")),
                       ("cross_dc", ("ours_stall_s", "baseline_stall_s", "stall_ratio"))):
        assert all(w[name][k] > 0 for k in keys), (name, w[name])
    s = w["standalone"]
    assert s["stall_ratio"] == pytest.approx(s["baseline_stall_s"] / s["ours_stall_s"], rel=1e-2)
    for name in ("standalone", "elastic", "cross_dc"):  # fewer trainer NICs send: the baseline is slower
        arm = w[name]
        base = arm.get("baseline_stall_s", arm.get("baseline_update_s"))
        assert arm["baseline_gathered"] > base, (name, arm["baseline_gathered"], base)
        assert arm["ratio_gathered"] > arm.get("stall_ratio", arm.get("update_ratio"))
    assert w["cross_dc"]["ours"]["wan_copies"] == pytest.approx(1.0)  # one copy crosses per version
    assert w["cross_dc"]["baseline"]["wan_copies"] > 1.0
    d = w["cross_dc"]["deltas"]  # the two-version runs, deltas off and on
    assert d["ratio"] == 0.058 and d["wan_bytes_ratio"] == pytest.approx(d["ratio"], rel=1e-2)
    assert d["ours"]["delta_chunks"] == 0 < d["ours_deltas"]["delta_chunks"]
    assert d["ours"]["wan_copies"] == d["ours_deltas"]["wan_copies"] == pytest.approx(1.0)  # the hub plans as ever
    assert d["remote_stall_ratio"] == pytest.approx(
        d["ours_deltas"]["remote_stall_s"] / d["ours"]["remote_stall_s"], rel=1e-2)
    assert d["stall_ratio_with_deltas"] == pytest.approx(
        d["baseline_deltas"]["remote_stall_s"] / d["ours_deltas"]["remote_stall_s"], rel=1e-2)
    assert result["calibration"]["rows"] == [] and result["calibration"]["max_error"] is None
    assert [r["rollout_gpus"] for r in result["curves"]["rows"]] == [4, 8]
    assert result["wall_s"] > 0 and "standalone.ours" in result["wall"]


def test_plot_writes_a_png(small, tmp_path):
    pytest.importorskip("matplotlib")
    result = {"curves": {"trainer_gpus": 4, "rows": [
        {"rollout_gpus": n, "ours_version_s": 1.0 + n, "star_version_s": 2.0 * n, "ours_hub_cpu_s": 0.1 * n,
         "star_hub_cpu_s": 0.05 * n} for n in (4, 8, 16)]}, "model_bytes": 10**9, "chunk_bytes": 1 << 26}
    out = tmp_path / "c.png"
    sim.plot(result, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chunk_mib_sets_the_chunk_of_the_cluster_scale_runs(small, tmp_path):
    measured = tmp_path / "m"
    measured.mkdir()
    halves = sim.run(params_file=small, measurements=measured, chunk_mib=32)
    assert halves["chunk_bytes"] == 32 << 20
    assert halves["workloads"]["standalone"]["ours_stall_s"] > 0
    with pytest.raises(ValueError, match="chunk_mib must be > 0"):
        sim.run(params_file=small, measurements=measured, chunk_mib=0)


def test_scale_rows_time_the_start_burst_the_version_waits_on(small):
    """``start_burst_s``: when the last reader had its first plan answered. Every
    reader's first plan, and every instance's resolve (four of 16 readers at TP 4:
    ``fetch.group_resolve``) or, with that off, every reader's, are served one at a
    time before then, so a hub charged 10 ms a request takes at least (16 + 4) x 10 ms,
    or 2 x 16 x 10 ms; the version ends after it."""
    p = load(small)
    rows = {}
    for overhead, group in ((0.0, True), (0.01, True), (0.01, False)):
        hub = p.hub.model_copy(update={"charge_cpu": True, "cpu_scale": 1e-9, "request_overhead_s": overhead})
        fetch = p.fetch.model_copy(update={"group_resolve": group})
        rows[overhead, group] = curves.scale(p.model_copy(update={"hub": hub, "fetch": fetch}), gpus=[16])["rows"][0]
    free, shared, each = rows[0.0, True], rows[0.01, True], rows[0.01, False]
    assert shared["start_burst_s"] >= (16 + 4) * 0.01
    assert each["start_burst_s"] >= 2 * 16 * 0.01
    assert each["start_burst_s"] - shared["start_burst_s"] >= 0.5 * 12 * 0.01  # the 12 resolves not asked
    assert 0 < free["start_burst_s"] < shared["start_burst_s"] / 2
    for row in (free, shared, each):
        assert row["start_burst_s"] < row["version_s"]
    assert shared["version_s"] - free["version_s"] >= 0.5 * (shared["start_burst_s"] - free["start_burst_s"])


def test_an_instances_ranks_resolve_once_between_them_and_read_the_same_bytes(small):
    """``fetch.group_resolve``: one ``Resolve`` per rollout instance reaches the hub
    (its ranks take the answer over their own group); off, one per rank. Nothing else
    about the fetch changes: the same chunks are read."""
    from tensorhub_cli.sim import workloads

    p = load(small)
    got = {}
    for group in (True, False):
        q = p.model_copy(update={"fetch": p.fetch.model_copy(update={"group_resolve": group})})
        got[group] = workloads.standalone(q, "ros", 4, 16, barrier=False)
    assert got[True]["hub_calls"]["resolve"] == 16 // 4 and got[False]["hub_calls"]["resolve"] == 16
    assert got[True]["bytes"] == got[False]["bytes"] > 0
