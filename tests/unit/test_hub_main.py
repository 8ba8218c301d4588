"""The hub process's flags: each bad value is one clear error naming the flag."""

import pytest

from tensorhub_cli.hub.__main__ import hub_config
from tensorhub_cli.hub.mustering import MUSTER_S


class Args:
    cluster, expiry_s, round_timeout_s, planner, retain, deltas = "c", 5.0, 120.0, "ros", [], []
    muster_s = MUSTER_S


def test_the_muster_defaults_on_and_zero_turns_it_off():
    assert hub_config(Args()).muster_s == MUSTER_S > 0
    off = Args()
    off.muster_s = 0.0
    assert hub_config(off).muster_s == 0.0


@pytest.mark.parametrize("bad", [-0.1, 11.0])
def test_a_muster_out_of_range_names_the_flag(bad):
    args = Args()
    args.muster_s = bad
    with pytest.raises(SystemExit, match="--muster-s"):
        hub_config(args)


def test_a_bad_delta_mode_names_the_flag():
    args = Args()
    args.deltas = ["m=sometimes"]
    with pytest.raises(SystemExit, match="--deltas"):
        hub_config(args)
