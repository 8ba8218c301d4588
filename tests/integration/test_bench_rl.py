"""`th bench rl` end to end on loopback (tiny model): both arms run real runners, and
the cross-DC workload sends one copy per version across the DC link."""

import pytest

from tensorhub_cli.bench import rl

pytestmark = pytest.mark.integration


def test_cross_dc_sends_one_copy_per_version_across_and_the_baseline_one_per_remote_load():
    # Big enough (21 MB) that the remote rollouts fetch each version at the same time.
    knobs = rl.Knobs(steps=2, rollouts=3, hidden=256, layers=4, step_s=2.0, rollout_s=0.05, timeout_s=180)
    result = rl.run("cross-dc", knobs)
    ours, base = result["ours"], result["baseline"]
    assert result["probe_mismatches"] == 0
    assert ours["version_bytes"] > 0 and ours["remote_versions"] >= 1
    # Contract 8: across a DC link one copy per version, however many remote readers.
    assert ours["remote_copies"] == ours["remote_versions"], ours
    # The baseline: every remote rollout pulls its own copy across (three here).
    assert base["remote_copies"] > base["remote_versions"], base
    assert set(result) >= {"workload", "ours", "baseline", "stall_ratio", "probe_mismatches"}
    for arm in (ours, base):
        assert set(arm) >= {"rollout_stall_s", "trainer_stall_s", "bytes_by_level"}
