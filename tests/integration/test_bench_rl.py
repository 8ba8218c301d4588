"""`th bench rl` end to end on loopback (tiny model): both arms run real runners, and
the cross-DC workload sends one copy per version across the DC link."""

import pytest

from tensorhub_cli.bench import rl

pytestmark = pytest.mark.integration


def test_cross_dc_sends_one_copy_per_version_across_and_the_baseline_one_per_remote_load():
    # Big enough (10 MB of bf16) that the remote rollouts fetch each version at the same
    # time; bf16 weights from float32 master weights at an RL-like rate, so the copy that
    # crosses for version 2 is deltas against version 1 (and a third arm runs without).
    knobs = rl.Knobs(steps=2, rollouts=3, hidden=256, layers=4, step_s=2.0, rollout_s=0.05, timeout_s=180,
                     dtype="bfloat16", lr=1e-5, deltas=True)
    result = rl.run("cross-dc", knobs)
    ours, base, full = result["ours"], result["baseline"], result["ours_full"]
    # (each rollout's probe recomputed from the bf16 weights it read equals the trainer's)
    assert result["probe_mismatches"] == 0
    second = ours["by_version"]["2"]
    assert second["remote_loads"] == 3 and second["delta_failed"] == 0, second
    # one crossing, by the far DC's feeders: as deltas, a small share of the version
    assert second["delta_reads"] > 0 and 0 < second["delta_wire_bytes"] < 0.25 * ours["version_bytes"], second
    assert full["by_version"]["2"]["delta_reads"] == 0 and base["by_version"]["2"]["delta_reads"] == 0
    assert result["delta"]["versions"] == ["2"] and result["delta"]["delta_failed"] == 0
    assert ours["version_bytes"] > 0 and ours["remote_versions"] >= 1
    # Contract 8: across a DC link one copy per version, however many remote readers.
    assert ours["remote_copies"] == ours["remote_versions"], ours
    # The baseline: every remote rollout pulls its own copy across (three here).
    assert base["remote_copies"] > base["remote_versions"], base
    assert set(result) >= {"workload", "ours", "baseline", "stall_ratio", "probe_mismatches"}
    for arm in (ours, base):
        assert set(arm) >= {"rollout_stall_s", "trainer_stall_s", "bytes_by_level"}


def test_elastic_joiners_read_a_replicated_version_from_rollouts_not_the_trainer():
    """Ours (double-buffered rollouts): a joiner's first fetch of a version the standing
    rollouts already hold reads 0 bytes from the trainer, even when the next version
    arrives meanwhile (the standing ones keep the old one published until a newer one
    needs its buffer). The baseline (star planner) reads that same join from the
    trainer: the counter is not 0 by construction."""
    knobs = rl.Knobs(steps=3, rollouts=2, hidden=256, layers=4, rollout_s=0.1, timeout_s=240)
    result = rl.run("elastic", knobs)
    ours, base = result["ours"], result["baseline"]
    assert result["probe_mismatches"] == 0
    assert ours["rollouts"] == "double-buffered" and base["rollouts"] == "in-place"
    assert ours["joins_replicated"] >= 1, ours  # else the run tested nothing
    assert ours["joiners_join_from_trainer_bytes"] == 0, ours
    if base["joins_replicated"]:
        assert base["joiners_join_from_trainer_bytes"] > 0, base
    # Staleness and skips are reported beside the stall, per arm and across arms.
    assert set(result) >= {"stall_ratio", "versions_skipped", "mean_staleness"}
    for arm in (ours, base):
        assert set(arm["loaded_versions"]) >= {"rollout-0", "rollout-1"}
        assert arm["loaded_versions"]["rollout-0"][-1] == knobs.steps
        assert arm["mean_staleness"] is not None and arm["mean_staleness"] >= 0


class _Events:
    def __init__(self, *events):
        self.events = [dict(e) for e in events]

    def of(self, kind):
        return [e for e in self.events if e["event"] == kind]


def test_staleness_is_the_trainers_newest_minus_the_generating_version_per_round_and_skips_count_loads():
    trainer = _Events(*({"event": "published", "version": v, "published_at": 10.0 * v} for v in (1, 2, 3)))
    rollout = _Events({"event": "generated", "version": 1, "began": 15.0, "t": 16.0, "rounds": 2, "tokens": 48},
                      {"event": "generated", "version": 1, "began": 25.0, "t": 26.0, "rounds": 1, "tokens": 24},
                      {"event": "generated", "version": 2, "began": 35.0, "t": 36.0, "rounds": 1, "tokens": 24},
                      {"event": "generated", "version": 3, "began": 5.0, "t": 5.0, "rounds": 0, "tokens": 0})
    # rounds 2 at 0, 1 at 1 (v2 out), 1 at 1 (v3 out); the empty window does not count
    assert rl._staleness([rollout], trainer) == (0.5, 1)
    assert rl._rate([rollout]) == 32.0  # 96 tokens over 3 s of windows
    # rollout-0 passed over 2; the joiner came in at 1 and left, its baseline twin met 2
    ours = {"loaded_versions": {"rollout-0": [1, 3], "rollout-1": [1, 2, 3], "rollout-spot-0": [1]}}
    base = {"loaded_versions": {"rollout-0": [1, 2, 3], "rollout-1": [1, 2, 3], "rollout-spot-0": [2]}}
    assert rl._skipped(ours, base) == 1
