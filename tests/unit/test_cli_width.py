"""What `th` prints reads at 80 columns and piped (issue 31): no name split across
lines, no line past 80, and every number that needs one has its legend.

Rich lays out for the console's width; a pipe is 80 unless COLUMNS says otherwise.
The fixture pins `th`'s consoles at 80 whatever the terminal running the tests.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from tensorhub_cli.cli import app
from tensorhub_cli.hub import protocol as p

from .test_cli import fake_cluster  # noqa: F401 (a fixture)

runner = CliRunner()
WIDTH = 80

# Names as long as real ones get: a node's second runner of a role, a spot agent.
NODES = ["node1", "node2", "node3"]
RUNNERS = ["trainer-node1", "rollout-node2", "rollout-node3", "rollout-node3-1", "rollout-node2-12"]


@pytest.fixture
def at_80(monkeypatch):
    from tensorhub_cli.ui import console

    for c in (console.out, console.err):
        monkeypatch.setattr(c, "_width", WIDTH)
    return WIDTH


def split_names(text: str, names: list[str]) -> list[str]:
    """Each name rich folded over two lines: a head ending a cell, the tail right under it."""
    lines = text.splitlines()
    found = []
    for name in names:
        for cut in range(1, len(name)):
            head, tail = name[:cut], name[cut:]
            for above, below in zip(lines, lines[1:]):
                for m in re.finditer(re.escape(head) + r"(?=[\s│┃]|$)", above):
                    if below[m.start():m.start() + len(tail)] == tail:
                        found.append(f"{head}|{tail}")
    return found


def assert_reads_at_80(text: str, names: list[str]) -> None:
    lines = text.splitlines()
    assert all(len(line) <= WIDTH for line in lines), "\n".join(line for line in lines if len(line) > WIDTH)
    assert not split_names(text, names), f"names split across lines: {split_names(text, names)}\n{text}"
    for name in names:
        assert any(re.search(rf"(^|[\s(]){re.escape(name)}($|[\s,)%])", line) for line in lines), \
            f"{name!r} is not whole on any line:\n{text}"


# --- th --help --------------------------------------------------------------------------


def test_help_reads_at_80_columns(at_80):
    for argv in (["--help"], ["bench", "--help"], ["bench", "faults", "--help"], ["versions", "--help"]):
        result = runner.invoke(app, argv, env={"COLUMNS": "80"})
        assert result.exit_code == 0
        names = ["up", "down", "status", "versions", "publish", "sync", "unpublish", "logs", "scale", "failover"] \
            if argv == ["--help"] else []
        assert_reads_at_80(result.output, names)


def test_bench_help_says_which_rows_need_root(at_80):
    text = runner.invoke(app, ["bench", "faults", "--help"], env={"COLUMNS": "80"}).output
    assert "link_down: it needs root and network namespaces" in " ".join(text.replace("│", " ").split()), text
    for workload in ("fanout", "rl"):
        text = runner.invoke(app, ["bench", workload, "--help"], env={"COLUMNS": "200"}).output
        assert "needs root and network namespaces" in text, workload


# --- th status, th versions ------------------------------------------------------------------


def a_status() -> p.StatusReply:
    eps = [p.EndpointStatus(name=f"agent-{n}", node=n, role="agent", kind="agent", alive=True, heartbeat_age_s=0.1,
                            replicas=2, rack="rack1", dc="dc1", reliable=n != "node3") for n in NODES]
    eps += [p.EndpointStatus(name=r, node=r.split("-")[1], role=r.split("-")[0], kind="endpoint", alive=True,
                             heartbeat_age_s=0.2, replicas=1, rack="rack1", dc="dc1") for r in RUNNERS]
    holders = [p.HolderStatus(name=f"agent-{n}", held_bytes=2**28, complete=True, reliable=n != "node3")
               for n in NODES]
    holders += [p.HolderStatus(name="rollout-node3-1", held_bytes=2**26, complete=False, reliable=False),
                p.HolderStatus(name="rollout-node2-12", held_bytes=2**28, complete=True, reliable=True, draining=True)]
    versions = [p.VersionStatus(model="policy", version=v, state=s, chunks=64, nbytes=2**28, replicas=5,
                                complete_replicas=4, reliable_copies=3, holders=holders)
                for v, s in ((11, "READY"), (12, "UNAVAILABLE"), (13, "STAGING"))]
    versions.append(p.VersionStatus(model="policy", version=10, state="READY", chunks=64, nbytes=2**28, replicas=1,
                                    complete_replicas=1, reliable_copies=1, holders=holders[:1]))
    return p.StatusReply(cluster="fake", uptime_s=12.0, endpoints=eps, versions=versions,
                         counters={"bytes_planned.node.host": 2**30, "errors.unknown_endpoint": 3, "ops": 1234})


@pytest.fixture
def hub_answers(monkeypatch, fake_cluster):
    from tensorhub_cli import cli_views
    from tensorhub_cli.launch import cluster

    reply = a_status()

    def ask(name, state, op, timeout=3.0):
        return (reply if isinstance(op, p.Status) else p.VersionsReply(versions=reply.versions)), None

    monkeypatch.setattr(cli_views, "ask_hub", ask)
    monkeypatch.setattr(cluster, "processes_alive", lambda name, state, **k: {
        ("hub", "node1"): True, **{("agent", n): True for n in NODES}})
    return fake_cluster


def test_status_reads_at_80_columns_piped(at_80, hub_answers):
    result = runner.invoke(app, ["status", "-c", hub_answers])
    assert result.exit_code == 0, result.output
    assert_reads_at_80(result.output, NODES + [f"agent-{n}" for n in NODES] + RUNNERS
                       + ["errors.unknown_endpoint", "bytes_planned.node.host"])


def test_versions_reads_at_80_columns_and_says_why_each_copy_stays(at_80, hub_answers):
    result = runner.invoke(app, ["versions", "-c", hub_answers])
    assert result.exit_code == 0, result.output
    assert_reads_at_80(result.output, ["agent-node1", "agent-node2", "agent-node3", "rollout-node3-1",
                                       "rollout-node2-12"])
    text = result.output
    # The columns are explained, with the spec's policy (specs/local.yaml: policy keeps 2, needs 1 reliable).
    assert "reliable: complete copies on reliable endpoints" in text
    assert "retained: one of the model's keep_latest newest versions" in " ".join(text.split())
    assert "policy: keep_latest 2, min_reliable_copies 1" in " ".join(text.split())
    rows = {int(line.split()[1]): line for line in text.splitlines() if line.startswith("policy ")}
    assert rows[12].split()[-1] == "yes" and rows[11].split()[-1] == "yes"  # the 2 newest once READY
    assert rows[10].split()[-1] == "no" and rows[13].split()[-1] == "no"  # older; never READY
    assert " 3/1 " in rows[12] and " 1 " in rows[10]  # reliable copies / the minimum, where retention applies
    assert "agent-node3 (spot)" in text and "rollout-node2-12 (draining)" in text and "rollout-node3-1 25%" in text


# --- every bench's table ----------------------------------------------------------------


FAULT_ROWS = [
    {"fault": f, "ok": True, "lost_bytes": 0, "recovery_s": rec, "slowdown": slow,
     "detail": f"{f}: the fetch completed from holderB after pubA was killed at 50% held; agent-node1, "
               "rollout-node3-1 and reader2 saw the published bytes"}
    for f, rec, slow in (("kill_source", -0.213, 1.02), ("kill_reader", 3.2, 3861.216), ("corrupt_chunk", 0.4, 1.3),
                         ("kill_hub", 1.9, 2.1), ("kill_agent", 2.5, None), ("slow_heartbeat", 0.6, 1.4),
                         ("zombie_read", 1.1, 1.6), ("bad_token", 0, 1.0), ("garbage_frames", 0, 1.0))]


def bench(monkeypatch, module: str, result: dict, argv: list[str]):
    """`th bench ...` at 80 columns with the workload's ``run`` answering ``result``:
    what it prints for an operator (its JSON aside)."""
    import importlib

    mod = importlib.import_module(f"tensorhub_cli.bench.{module}")
    monkeypatch.setattr(mod, "run", lambda *a, **k: result)
    done = runner.invoke(app, ["bench", *argv])
    assert done.exit_code == 0, done.output
    # (the first stderr line says what starts: a progress line, printed as is, left to the terminal to wrap)
    return done.stderr.split("\n", 1)[1] + (done.stdout if argv[0] == "faults" else "")


def test_bench_faults_table_has_a_legend_and_whole_details(at_80, monkeypatch):
    result = {"workload": "faults", "bytes": 16 << 20, "engine": "tcp", "rows": FAULT_ROWS, "ok": True,
              "skipped": {"link_down": "the testbed needs root (network namespaces)"}}
    text = bench(monkeypatch, "faults", result, ["faults", "--mib", "16"])
    assert_reads_at_80(text, [r["fault"] for r in FAULT_ROWS] + ["-0.213", "3861.216", "holderB", "rollout-node3-1"])
    flat = " ".join(text.split())
    assert "recovery s: the time the fault cost" in flat and "slowdown: the faulted operation's time ÷" in flat
    assert "small negative value is timing noise" in flat
    assert "link_down: skipped: the testbed needs root" in flat
    for row in FAULT_ROWS:  # each detail whole, after its fault's name, not squeezed into a column
        assert f"{row['fault']}: {row['detail']}" in flat


def test_bench_p2p_says_which_way_its_ratios_go(at_80, monkeypatch):
    same = {"workload": "p2p", "layout": "same", "bytes": 16 << 20, "engine": "nixl", "reps": 3, "ours_s": 0.052,
            "raw_nixl_s": 0.030, "raw_tcp_s": 0.041, "ratio_vs_raw_nixl": 0.577, "ratio_vs_raw_tcp": 0.788,
            "target": {"ratio_vs_raw_nixl": 0.9}, "target_met": False}
    text = bench(monkeypatch, "p2p", same, ["p2p", "--mib", "16"])
    assert_reads_at_80(text.split("\n}\n")[-1], ["ours (endpoint fetch)", "raw NIXL READ", "raw TCP stream"])
    flat = " ".join(text.split())
    assert "ratio_vs_raw_nixl 0.577 = raw NIXL seconds ÷ ours: 1 is as fast as raw NIXL, below 1 ours is slower" \
        in flat and "ours takes 1.73× raw NIXL's time" in flat and "missed" in flat
    tp2 = {"workload": "p2p", "layout": "tp2", "bytes": 16 << 20, "engine": "tcp", "reps": 3, "time_ratio": 0.91,
           "bytes_over_share": 1.02, "tp2": {"s": 0.3, "bytes_per_rank": [9 << 20]},
           "same": {"s": 0.27, "bytes_per_rank": [8 << 20]}}
    text = bench(monkeypatch, "p2p", tp2, ["p2p", "--mib", "16", "--layout", "tp2"]).split("\n}\n")[-1]
    assert_reads_at_80(text, ["tp2 (vLLM TP-2 slices)", "same (Shard(0) rows)"])
    assert "time_ratio 0.910 = same-layout seconds ÷ tp2 seconds" in " ".join(text.split())


def test_bench_fanout_rl_and_hub_tables_read_at_80(at_80, monkeypatch):
    row = {"readers": 15, "ours_s": 1.23, "star_s": 9.87, "broadcast_s": 3.21, "star_vs_ours": 8.02,
           "broadcast_vs_ours": 2.61, "bound_s": 1.01, "ours_vs_bound": 1.22, "star_vs_bound": 9.77}
    fanout = {"bytes": 128 << 20, "engine": "nixl", "warmup": True, "target_met": True, "rows": [row, row]}
    assert_reads_at_80(bench(monkeypatch, "fanout", fanout, ["fanout", "--readers", "15"]).split("\n}\n")[-1],
                       ["readers", "broadcast", "8.02", "9.77"])
    arm = {"planner": "ros", "rollouts": 3, "rollout_stall_s": 1.5, "trainer_stall_s": 0.2, "versions_loaded": 4,
           "mean_staleness": 0.5, "bytes_by_level": {"node": 1e9, "rack": 2e9, "dc": 3e9, "remote": 0},
           "joiners_join_from_trainer_bytes": 5e8}
    rl = {"workload": "cross-dc", "stall_ratio": 3.2, "versions_skipped": 1, "probe_mismatches": 0,
          "ours": arm, "baseline": {**arm, "planner": "star", "mean_staleness": None}}
    text = bench(monkeypatch, "rl", rl, ["rl", "--workload", "cross-dc"]).split("\n}\n")[-1]
    assert_reads_at_80(text, ["rollout stall s", "joins ← trainer MB", "star"])
    phase = {"depth": 64, "ops_per_s": 12345, "plan_p50_ms": 1.2, "plan_p99_ms": 4.5, "hub_cpu_util": 0.97,
             "hub_cpu_s": 12.3}
    hub = {"endpoints": 1000, "target": {"plan_p99_ms": 10, "ops_per_s": 5000}, "target_met": True,
           "throughput": phase, "latency": phase}
    assert_reads_at_80(bench(monkeypatch, "hub", hub, ["hub"]).split("\n}\n")[-1], ["throughput", "latency"])
    ph = {"ops": {"plan": 100, "beat": 50}, "plans": 100, "waits": 3, "hub_cpu_s": 1.5, "ops_per_cpu_s": 100,
          "cpu_us": {"plan": 900}, "plans_digest": "0123456789abcdef"}
    replay = {"endpoints": 1000, "planner": "ros", "v1": ph, "v2": ph}
    assert_reads_at_80(bench(monkeypatch, "hubreplay", replay, ["hub", "--replay"]).split("\n}\n")[-1],
                       ["0123456789abcdef"])
