"""The supervisor's restart arithmetic and its outcome record, without processes."""

from __future__ import annotations

import pytest

from tensorhub_cli.agent.supervise import OUTCOME_TAG, Restarts, exited_line, outcome_of, parse


def test_on_failure_restarts_a_crash_with_doubling_backoff_and_leaves_a_clean_exit():
    r = Restarts("on-failure", max_restarts=3, window_s=100, backoff_s=1.0)
    assert r.after(1, now=0.0) == ("restart", 1.0)
    assert r.after(-9, now=1.0) == ("restart", 2.0)
    assert r.after(0, now=2.0) == ("finished", 0.0)


def test_gives_up_after_max_restarts_within_the_window_and_forgets_old_ones():
    r = Restarts("always", max_restarts=2, window_s=10, backoff_s=0.5)
    assert r.after(0, 0.0)[0] == "restart"  # always: even a clean exit
    assert r.after(1, 1.0)[0] == "restart"
    assert r.after(1, 2.0) == ("gave_up", 0.0)
    # 11 s later both earlier restarts left the window: allowed again, backoff reset
    assert r.after(1, 12.5) == ("restart", 0.5)


def test_never_leaves_it_dead_and_the_backoff_is_capped():
    assert Restarts("never").after(1, 0.0) == ("exited", 0.0)
    r = Restarts("always", max_restarts=50, window_s=1e9, backoff_s=10)
    delays = [r.after(1, float(i))[1] for i in range(8)]
    assert delays[:3] == [10, 20, 40] and max(delays) == 60


def test_outcome_is_this_supervisors_last_record_never_an_older_ones():
    """One log serves every restart of a name: a record (or an exit line) of an earlier
    supervisor must not speak for the one `th up` asks about."""
    tail = (f"[th-supervise] trainer-node1[40]: runner exited with status 1\n"
            f'{OUTCOME_TAG}{{"outcome": "gave_up", "exit": 1, "restarts": 5, "pid": 40}}\n'
            f"[th-supervise] trainer-node1[41]: started runners.trainer (pid 7)\n"
            f'{OUTCOME_TAG}{{"outcome": "finished", "exit": 0, "restarts": 1, "pid": 41}}\n'
            f"[th-supervise] trainer-node1[42]: started runners.trainer (pid 9)\n")
    assert outcome_of(tail, 41) == {"outcome": "finished", "exit": 0, "restarts": 1, "pid": 41}
    assert outcome_of(tail, 40)["outcome"] == "gave_up"
    assert outcome_of(tail, 42) is None  # killed -9: it wrote none, and 41's is not its own
    assert exited_line("trainer-node1", 40) in tail and exited_line("trainer-node1", 42) not in tail
    assert outcome_of("[th-supervise] x[3]: started m (pid 4)\nTraceback ...", 3) is None


def test_runner_arguments_after_the_separator_are_never_ours():
    args = parse(["--name", "r", "--policy", "always", "--", "runners.rollout", "--name", "other", "--hub", "h"])
    assert (args.name, args.policy, args.hub) == ("r", "always", None)
    assert (args.module, args.runner_args) == ("runners.rollout", ["--name", "other", "--hub", "h"])
    with pytest.raises(SystemExit):
        parse(["--name", "r"])  # no runner
