"""The command surface: every DESIGN.md command exists and refuses bad input by name."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tensorhub_cli.cli import app

runner = CliRunner()

COMMANDS = ["spec", "up", "down", "status", "publish", "sync", "versions", "scale", "failover", "logs", "bench"]


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert any(line.strip().startswith(name + " ") or line.strip("│ ").startswith(name + " ")
                   for line in result.output.splitlines()), name


@pytest.mark.parametrize("argv", [["scale", "rollout=4"], ["failover", "node2"]])
def test_scale_and_failover_need_a_running_cluster(th_home, argv):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert "no cluster is running" in result.output


def test_scale_changes_are_parsed_against_the_spec_by_name():
    from pathlib import Path

    from tensorhub_cli.launch.scale import BadInput, parse_change
    from tensorhub_cli.spec import load

    spec = load(Path(__file__).resolve().parents[2] / "specs" / "local.yaml")
    assert parse_change("rollout=4", spec, {"rollout": 2}).target == 4
    assert parse_change("rollout+1", spec, {"rollout": 2}).target == 3
    assert parse_change("rollout-2", spec, {"rollout": 2}).target == 0
    for text, needle in (("rollout-3", "cannot go below 0"), ("critic=2", "role 'critic' is not in the spec"),
                         ("agent=2", "not scaled"), ("rollout", "expected ROLE=COUNT")):
        with pytest.raises(BadInput, match=needle):
            parse_change(text, spec, {"rollout": 2})


@pytest.mark.parametrize("argv, needle", [
    (["sync", "policy"], "exactly one of --role ROLE or --node NODE"),
    (["sync", "policy", "--role", "rollout", "--node", "node2"], "exactly one of"),
    (["sync", "policy", "--role", "rollout", "--version", "seven"], "--version must be a number or 'latest'"),
    (["publish", "policy", "--from", "x.safetensors"], "no cluster is running"),
])
def test_publish_and_sync_refuse_bad_input_by_name(th_home, argv, needle):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert needle in result.output


def test_status_without_cluster_is_a_clear_error(th_home):
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 2
    assert "no cluster is running" in result.output


def test_bench_has_one_subcommand_per_workload_each_with_its_own_options():
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0
    for name in ("hub", "p2p", "fanout", "rl"):
        assert any(line.strip("│ ").startswith(name + " ") for line in result.output.splitlines()), name
    for argv, option in ((["bench", "hub", "--testbed"], "--testbed"), (["bench", "p2p", "--plot", "x.png"], "--plot"),
                         (["bench", "rl", "--readers", "1,2"], "--readers")):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2, argv
        assert f"No such option: {option}" in result.output, argv


def test_bench_refuses_an_unknown_workload_by_name():
    result = runner.invoke(app, ["bench", "warp"])
    assert result.exit_code == 2
    assert "unknown workload 'warp' (known: hub, p2p, fanout, faults, rl)" in result.output


def test_nixl_shim_finds_the_backend_wheel(monkeypatch):
    from tensorhub_cli.engines.nixl_shim import NixlUnavailable, load_nixl

    assert hasattr(load_nixl(), "nixl_agent")
    monkeypatch.setenv("TH_NIXL_MODULE", "nixl_absent")
    with pytest.raises(NixlUnavailable, match="nixl_absent._api"):
        load_nixl()
