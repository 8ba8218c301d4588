"""Calibration: stored measurement files in, predicted rows out."""

import json

import pytest

from tensorhub_cli.sim import calibrate
from tensorhub_cli.sim.params import SimParams

S = 16 << 20
NODE_MBIT = 500.0


def quiet() -> SimParams:
    """No loop costs, no hub CPU charged: predictions are closed forms."""
    p = SimParams()
    tb = p.testbed.model_copy(update={"request_overhead_s": 0.0, "fetch": p.testbed.fetch.model_copy(update={
        "plan_rtt_s": 0.0, "verify_s": 0.0, "verify_gbps": 1e9, "report_s": 0.0})})
    return p.model_copy(update={"testbed": tb, "hub": p.hub.model_copy(update={"charge_cpu": False})})


def fanout_file(rows, check=None) -> dict:
    testbed = {"nodes": 8, "racks": 2, "rates_mbit": {"node": NODE_MBIT, "rack": 2 * NODE_MBIT}}
    if check is not None:
        testbed["check"] = check
    return {"command": "th bench fanout --testbed --json", "date": "2026-01-01", "commit": "abc",
            "result": {"workload": "fanout", "testbed": testbed, "bytes": S, "chunk_bytes": 1 << 20, "window": 4,
                       "warmup": True, "rows": rows}}


def test_reader_placement_follows_the_bench():
    per, order = calibrate.testbed_layout(8, 2)
    assert per == 4 and order[:3] == ["n2", "n5", "n3"]  # alternating racks, n1 is the publisher's


def test_broadcast_is_a_binomial_tree_whose_ranks_send_to_all_children_at_once():
    full = {"node": 1.0, "duplex": None, "rack": 1.0}
    bound = S * 8 / (NODE_MBIT * 1e6)
    # 1 reader: one send. 3: n1 sends to ranks 1 and 2 at once (2 S/B), then 1 -> 3 (3).
    # 7: n1 -> 1, 2, 4 at once (3); 1 -> 3, 5 (5); 3 -> 7 (6). Rack uplinks at 2x never bind here.
    for readers, rounds in ((1, 1), (3, 3), (7, 6)):
        t = calibrate.broadcast_time(readers=readers, nbytes=S, node_mbit=NODE_MBIT, rack_mbit=None, eff=full)
        assert t == pytest.approx(rounds * bound, rel=1e-6)


def test_rows_compare_prediction_and_measurement():
    full = [{"link": "node", "expect_mbit": NODE_MBIT, "achieved_mbit": NODE_MBIT},
            {"link": "duplex", "expect_mbit": 2 * NODE_MBIT, "achieved_mbit": 2 * NODE_MBIT},
            {"link": "rack", "expect_mbit": 2 * NODE_MBIT, "achieved_mbit": 2 * NODE_MBIT}]
    bound = S * 8 / (NODE_MBIT * 1e6)
    files = [("f.json", fanout_file([{"readers": 3, "ours_s": bound * 1.5, "star_s": 3 * bound * 1.1}], full))]
    rows, skipped = calibrate.rows(quiet(), files)
    assert skipped == []
    by = {r["scenario"]: r for r in rows}
    star = by["fanout star readers=3"]
    assert star["predicted_s"] == pytest.approx(3 * bound, rel=1e-3)  # the publisher's link, three copies
    assert star["error"] == pytest.approx(abs(3 * bound - 3 * bound * 1.1) / (3 * bound * 1.1), abs=1e-3)
    assert by["fanout ours readers=3"]["predicted_s"] < star["predicted_s"]


def test_the_link_check_sets_the_efficiency():
    bound = S * 8 / (NODE_MBIT * 1e6)
    half = [{"link": "node", "expect_mbit": NODE_MBIT, "achieved_mbit": NODE_MBIT / 2}]
    rows, _ = calibrate.rows(quiet(), [("f.json", fanout_file([{"readers": 1, "star_s": 2 * bound}], half))])
    assert rows[0]["predicted_s"] == pytest.approx(2 * bound, rel=1e-3)


def test_other_benches_are_listed_as_skipped(tmp_path):
    (tmp_path / "rl.json").write_text(json.dumps({"command": "th bench rl", "date": "d", "commit": "c",
                                                  "result": {"workload": "standalone", "site": "testbed"}}))
    (tmp_path / "notes.txt").write_text("not a measurement")
    rows, skipped = calibrate.rows(quiet(), calibrate.measurements(tmp_path))
    assert rows == [] and len(skipped) == 1 and skipped[0].startswith("rl.json")


def test_cold_rows_are_not_compared():
    doc = fanout_file([{"readers": 1, "star_s": 1.0}])
    doc["result"]["warmup"] = False
    rows, skipped = calibrate.rows(quiet(), [("cold.json", doc)])
    assert rows == [] and "warm-up" in skipped[0]


def test_a_file_without_its_command_is_refused(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"result": {}}))
    with pytest.raises(ValueError, match="bad.json.*command"):
        calibrate.measurements(tmp_path)


def test_the_one_host_of_the_testbed_bounds_every_transfer_together():
    full = {"node": 1.0, "duplex": None, "rack": 1.0}
    bound = S * 8 / (NODE_MBIT * 1e6)
    common = dict(nbytes=S, chunk_bytes=1 << 20, window=4, node_mbit=NODE_MBIT, rack_mbit=None, eff=full)
    # The host carries what 1.5 node links carry: 3 star readers need 3 S/B through n1's
    # link and 2 S/B through the host: the link binds. At half a link the host binds.
    for host, readers, expect in ((1.5, 1, 1), (1.5, 3, 3), (0.5, 1, 2), (0.5, 3, 6)):
        t = calibrate.fanout_time(quiet(), readers=readers, planner="star",
                                  host_bytes_per_s=host * NODE_MBIT * 1e6 / 8, **common)
        assert t == pytest.approx(expect * bound, rel=0.02), (host, readers)


def test_host_rate_is_cores_over_cpu_per_byte_received():
    res = {"bytes": S, "rows": [{"readers": 1, "ours_endpoint_cpu_s": 0.5, "ours_cpu_floor_s": 0.25},
                                {"readers": 3, "ours_endpoint_cpu_s": 1.5, "ours_cpu_floor_s": 0.75}]}
    assert calibrate.host_rate(res) == pytest.approx(2 / (2.0 / (4 * S)))
    assert calibrate.host_rate({"bytes": S, "rows": [{"readers": 1, "ours_s": 1.0}]}) is None


def rl_file(workload: str, arms: dict) -> dict:
    full = [{"link": "node", "expect_mbit": NODE_MBIT, "achieved_mbit": NODE_MBIT},
            {"link": "rack", "expect_mbit": 2 * NODE_MBIT, "achieved_mbit": 2 * NODE_MBIT}]
    knobs = {"rollouts": 3, "chunk_mb": 1.0, "window": 4}
    return {"command": f"th bench rl --workload {workload} --testbed --json", "date": "2026-01-01", "commit": "abc",
            "result": {"workload": workload, "site": "testbed", "knobs": knobs, "check": full,
                       "rates_mbit": {"node": NODE_MBIT, "rack": 2 * NODE_MBIT},
                       **{arm: {"version_bytes": S, **fields} for arm, fields in arms.items()}}}


def test_rl_standalone_rows_predict_each_arms_fetch_loop():
    bound = S * 8 / (NODE_MBIT * 1e6)
    doc = rl_file("standalone", {"ours": {"loop_by_version": {"1": [bound, 1.2 * bound, 1.4 * bound]}},
                                 "baseline": {"loop_by_version": {"1": [3 * bound] * 3, "2": [2.7 * bound] * 3}}})
    rows, skipped = calibrate.rows(quiet(), [("rl.json", doc)])
    by = {r["scenario"].split(" rollouts")[0]: r for r in rows}
    assert skipped == [] and set(by) == {"rl standalone ours v1", "rl standalone baseline every version"}
    base = by["rl standalone baseline every version"]
    # Star: three rollouts share the trainer's link, each for the whole of it. Measured:
    # the mean over every version's loads.
    assert base["predicted_s"] == pytest.approx(3 * bound, rel=0.02)
    assert base["measured_s"] == pytest.approx(2.85 * bound, rel=1e-3)
    ours = by["rl standalone ours v1"]
    assert ours["measured_s"] == pytest.approx(1.2 * bound, rel=1e-3)
    assert bound * 0.99 < ours["predicted_s"] < 2 * bound  # relays: well under the star's three copies


def test_rl_elastic_rows_predict_a_joiner_of_a_replicated_version():
    bound = S * 8 / (NODE_MBIT * 1e6)
    doc = rl_file("elastic", {"ours": {"loop_by_version": {}, "joiners_join_loop_s": [bound, bound]},
                              "baseline": {"loop_by_version": {}, "joiners_join_loop_s": [1.1 * bound]}})
    rows, _ = calibrate.rows(quiet(), [("rl.json", doc)])
    by = {r["scenario"]: r for r in rows}
    # Alone, a joiner reads at its own link's rate whoever it reads from.
    for arm in ("ours", "baseline"):
        assert by[f"rl elastic {arm} joiner of a replicated version (mean fetch loop)"]["predicted_s"] == \
            pytest.approx(bound, rel=0.02)


def test_ours_rows_of_a_scheduled_file_count_only_once_the_hub_mustered():
    """Before musters the hub chained readers in their plans' arrival order, which the
    file does not record (and which moved N = 7 by a fifth): those rows are skipped."""
    bound = S * 8 / (NODE_MBIT * 1e6)
    doc = fanout_file([{"readers": 3, "ours_s": 1.2 * bound, "star_s": 3 * bound}])
    doc["result"]["protocol"] = "schedule"
    rows, skipped = calibrate.rows(quiet(), [("old.json", doc)])
    assert [r["scenario"] for r in rows] == ["fanout star readers=3"]
    assert skipped and "old.json: ours' rows" in skipped[0]
    doc["result"].update(muster_s=0.05, heads="serial")
    rows, skipped = calibrate.rows(quiet(), [("new.json", doc)])
    assert {r["scenario"] for r in rows} == {"fanout ours readers=3", "fanout star readers=3"} and not skipped
    ours = next(r for r in rows if r["scenario"].startswith("fanout ours"))
    assert ours["predicted_s"] >= 0.05 + bound  # (the muster's wait, then at least the bound)
