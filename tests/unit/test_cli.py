"""The command surface: every DESIGN.md command exists and refuses bad input by name."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from tensorhub_cli.cli import app

runner = CliRunner()

COMMANDS = ["spec", "up", "down", "status", "publish", "sync", "unpublish", "versions", "scale", "failover", "logs",
            "bench"]


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
    assert "unknown workload 'warp' (known: hub, p2p, fanout, faults, rl, delta, sim)" in result.output


def test_nixl_shim_finds_the_backend_wheel(monkeypatch):
    from tensorhub_cli.engines.nixl_shim import NixlUnavailable, load_nixl

    assert hasattr(load_nixl(), "nixl_agent")
    monkeypatch.setenv("TH_NIXL_MODULE", "nixl_absent")
    with pytest.raises(NixlUnavailable, match="nixl_absent._api"):
        load_nixl()


# --- CLI conventions (issue 22: "tried as a new user would") ------------------------


def _commands():
    """(path, click command) for every command and group `th` has."""
    import typer.main

    root = typer.main.get_command(app)
    todo = [(["th"], root, None)]
    while todo:
        path, cmd, parent = todo.pop()
        ctx = typer.Context(cmd, info_name=path[-1], parent=parent)
        yield path, cmd, ctx
        if hasattr(cmd, "list_commands"):
            todo += [(path + [n], cmd.get_command(ctx, n), ctx) for n in cmd.list_commands(ctx)]


def test_version_short_help_and_shell_completion():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"th (tensorhub-ros) {version('tensorhub-ros')}"
    for argv in (["-h"], ["up", "-h"], ["bench", "fanout", "-h"], ["spec", "check", "-h"]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 0 and "Usage: " in result.output, argv
    # What a shell's completion function runs (the script `th --show-completion` installs
    # calls this); `--show-completion` itself detects the parent shell, which under
    # `make` is sh, so it is not what is tested here.
    done = runner.invoke(app, [], prog_name="th",
                         env={"_TH_COMPLETE": "complete_bash", "COMP_WORDS": "th sta", "COMP_CWORD": "1"})
    assert done.exit_code == 0 and done.output.split() == ["status"], done.output
    top = runner.invoke(app, ["-h"]).output
    assert "--install-completion" in top and "--show-completion" in top  # offered to users


def test_every_option_has_help_and_a_conventional_metavar():
    seen = 0
    for path, cmd, ctx in _commands():
        for param in cmd.get_params(ctx):
            seen += 1
            assert param.help, f"{' '.join(path)} {param.opts}: no help text"
        result = runner.invoke(app, [*path[1:], "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, path
        usage = next(line for line in result.output.splitlines() if "Usage:" in line)
        assert "{" not in usage and "<bool>" not in result.output, (path, result.output)
    assert seen > 60
    usage = runner.invoke(app, ["versions", "--help"], prog_name="th", env={"COLUMNS": "200"}).output
    assert "th versions [OPTIONS] [MODEL]" in usage
    sync = runner.invoke(app, ["sync", "--help"], env={"COLUMNS": "200"}).output
    assert re.search(r"--role +ROLE ", sync) and "agent: every node's agent" in sync, sync


@pytest.fixture
def fake_cluster(th_home):
    """A recorded cluster whose processes are not ours (this PID, another start
    time: nothing is ever signalled) and whose hub nobody runs."""
    import os

    from tensorhub_cli.launch.procs import ProcRecord
    from tensorhub_cli.launch.state import ClusterState, cluster_dir, write_state, write_token

    from ..conftest import REPO

    procs = [ProcRecord(role=role, node=node, pid=os.getpid(), starttime=1, marker="never-matches", log="")
             for role, node in (("hub", "node1"), ("agent", "node3"), ("agent", "node1"), ("agent", "node2"))]
    write_state(ClusterState(cluster="fake", launcher="local", hub_address="tcp://127.0.0.1:9",
                             hub_node_address="127.0.0.1", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0,
                             procs=procs))
    write_token("fake", None)
    (cluster_dir("fake") / "spec.yaml").write_text((REPO / "specs" / "local.yaml").read_text())
    return "fake"


def test_down_is_idempotent_and_quiet_keeps_only_the_result(th_home, fake_cluster):
    loud = runner.invoke(app, ["down", "-c", fake_cluster])
    assert loud.exit_code == 0 and "not running" in loud.output and "cluster 'fake' is down" in loud.output
    for argv in (["down"], ["down", "-c", "fake"], ["down", "-c", "other"]):
        again = runner.invoke(app, argv)
        assert again.exit_code == 0, (argv, again.output)
        assert "nothing to stop" in again.output, argv


def test_quiet_drops_progress_lines(th_home, fake_cluster):
    quiet = runner.invoke(app, ["-q", "down", "-c", fake_cluster])
    assert quiet.exit_code == 0 and quiet.output.strip() == "cluster 'fake' is down", quiet.output


def test_errors_name_the_command_and_never_a_protocol_code(th_home, fake_cluster, monkeypatch):
    from tensorhub_cli import cli_views
    from tensorhub_cli.hub import protocol as p
    from tensorhub_cli.hub.client import HubError

    refused = HubError(p.Error(code="not_found", message="model 'polcy' has no versions"))
    monkeypatch.setattr(cli_views, "ask_hub", lambda *a, **k: (None, refused))
    result = runner.invoke(app, ["versions", "polcy", "-c", fake_cluster])
    assert result.exit_code == 2
    assert result.output.strip() == "th versions: model 'polcy' has no versions", result.output
    for argv, prefix in ((["scale", "rollout=4", "-c", "nope"], "th scale: "),
                         (["failover", "node2", "-c", "nope"], "th failover: "),
                         (["logs", "node9", "-c", fake_cluster], "th logs: ")):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2 and result.output.startswith(prefix), (argv, result.output)


def test_an_instant_sync_shows_a_dash_for_its_rate():
    from rich.console import Console

    from tensorhub_cli.launch.operate import SyncRun, Target
    from tensorhub_cli.ui.sync import SyncView

    console = Console(record=True, width=160, force_terminal=False)
    run = SyncRun(model="policy", version=1, nbytes=2**20,
                  targets={"agent-node2": Target("agent-node2", held_bytes=2**20, done=True)})
    with SyncView(console) as view:
        view.update(run)
    row = next(line for line in console.export_text().splitlines() if "agent-node2" in line)
    assert "?" not in row and " - " in row and "done" in row, row


def test_install_metadata_has_no_deprecated_license_table(monkeypatch):
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    from ..conftest import REPO

    monkeypatch.chdir(REPO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert [str(w.message) for w in caught if "license" in str(w.message).lower()] == []
    assert dist.metadata.license_expression == "Apache-2.0"


@pytest.mark.parametrize("argv, says", [
    (["bench", "rl", "--workload", "cross-dc", "--wan-mbit", "100"], "--wan-mbit is the testbed's DC link rate"),
    (["bench", "rl", "--workload", "standalone", "--testbed", "--wan-mbit", "100"], "needs --testbed and --workload cross-dc"),
    (["bench", "rl", "--workload", "elastic", "--deltas"], "--deltas compares deltas across DCs"),
    (["bench", "rl", "--dtype", "float16"], "--dtype must be float32 or bfloat16"),
])
def test_bench_rl_refuses_delta_flags_that_cannot_apply_naming_them(argv, says):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert says in result.output.replace("\n", " "), result.output
