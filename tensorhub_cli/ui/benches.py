"""The tables `th bench` prints on stderr, one ``render_bench_<workload>`` each (the
JSON on stdout is the result; these only read it). Each is a ``tables.Grid`` (reads at
80 columns) and says what its ratios mean: which way each divides, and what good is.
"""

from __future__ import annotations

from rich.console import Console

from .tables import Grid

# `th bench faults`: what its numbers mean, printed under the table.
FAULTS_LEGEND = (
    "ok: the contract the fault threatens held. lost bytes: bytes of the reader's copy that differ from the "
    "published ones once its fetch returned (0 is the only good value).\n"
    "recovery s: the time the fault cost, as each row defines it (kill_source, link_down: completion time beyond "
    "what the rest of an unfaulted fetch takes, so near 0 is good and a small negative value is timing noise; "
    "kill_hub, kill_agent: until the version is READY again; kill_reader, zombie_read, nixl_giveup: how long the source's "
    "unpublish waited; slow_heartbeat: until the hub heard the stopped source again).\n"
    "slowdown: the faulted operation's time ÷ the same operation without the fault, both in this run "
    "(1 = no cost; below 1 the fault sent the reader to a faster source, e.g. corrupt_chunk's clean holder is not "
    "throttled; kill_reader's unpublish waits for the hub to expire the dead reader, hence thousands).\n"
    "-: not measured for that fault. Each row's detail follows; `th bench faults --help` and --json say more.")


def render_bench_hub(console: Console, r: dict) -> None:
    t = Grid("phase", "in flight", "ops/s", "plan p50 ms", "plan p99 ms", "hub CPU", "hub CPU s / version",
             title=f"hub bench: {r['endpoints']} endpoints", names=("phase",))
    for phase in ("throughput", "latency"):
        ph = r[phase]
        t.add_row(phase, str(ph["depth"]), f"{ph['ops_per_s']:.0f}", f"{ph['plan_p50_ms']:.2f}",
                  f"{ph['plan_p99_ms']:.2f}", f"{ph['hub_cpu_util']:.0%}", f"{ph['hub_cpu_s']:.2f}")
    console.print(t)
    console.print(f"target: plan p99 ≤ {r['target']['plan_p99_ms']} ms and ≥ {r['target']['ops_per_s']} ops/s: "
                  f"{'met' if r['target_met'] else 'missed'}", highlight=False, markup=False)


def render_bench_hub_replay(console: Console, r: dict) -> None:
    t = Grid("version", "ops", "plans", "waits", "hub CPU s", "ops / CPU s", "plan µs", "plans digest", title=(
        f"hub replay: {r['endpoints']} endpoints, {r['planner']} planner, fixed schedule, no sockets"),
        names=("version", "plans digest"))
    for key in ("v1", "v2"):
        ph = r[key]
        t.add_row(key, str(sum(ph["ops"].values())), str(ph["plans"]), str(ph["waits"]), f"{ph['hub_cpu_s']:.2f}",
                  f"{ph['ops_per_cpu_s']:.0f}", f"{ph['cpu_us'].get('plan', 0):.0f}", ph["plans_digest"])
    console.print(t)


def render_bench_p2p(console: Console, r: dict) -> None:
    """Seconds per method and each ratio spelled out: baseline time ÷ ours, so 1 is as
    fast as the baseline and below 1 slower (``ratio_vs_raw_nixl`` in the JSON)."""
    mib = r["bytes"] / 2**20
    if r.get("layout") == "tp2":
        t = Grid("layout", "seconds", "MiB read per rank", title=f"p2p tp2: {mib:.0f} MiB model, {r['engine']}, "
                 f"median of {r['reps']}", names=("layout",))
        for key, label in (("tp2", "tp2 (vLLM TP-2 slices)"), ("same", "same (Shard(0) rows)")):
            t.add_row(label, f"{r[key]['s']:.3f}", f"{max(r[key]['bytes_per_rank']) / 2**20:.1f}")
        console.print(t)
        console.print(f"time_ratio {r['time_ratio']:.3f} = same-layout seconds ÷ tp2 seconds (1 = the TP-2 layout "
                      f"costs nothing extra; below 1 it is slower). bytes_over_share {r['bytes_over_share']:.3f}: "
                      "the most a rank read ÷ the bytes its slice needs (1 = no extra bytes).",
                      highlight=False, markup=False)
        return
    t = Grid("method", "seconds", "Gbit/s", "baseline s ÷ ours s", title=f"p2p: {mib:.0f} MiB between two "
             f"processes, {r['engine']}, median of {r['reps']}", names=("method",))
    gbps = r["bytes"] * 8 / 1e9
    t.add_row("ours (endpoint fetch)", f"{r['ours_s']:.3f}", f"{gbps / r['ours_s']:.2f}", "-")
    t.add_row("raw NIXL READ", f"{r['raw_nixl_s']:.3f}", f"{gbps / r['raw_nixl_s']:.2f}",
              f"{r['ratio_vs_raw_nixl']:.3f}")
    t.add_row("raw TCP stream", f"{r['raw_tcp_s']:.3f}", f"{gbps / r['raw_tcp_s']:.2f}", f"{r['ratio_vs_raw_tcp']:.3f}")
    console.print(t)
    nixl = r["ratio_vs_raw_nixl"]
    console.print(f"ratio_vs_raw_nixl {nixl:.3f} = raw NIXL seconds ÷ ours: 1 is as fast as raw NIXL, below 1 ours "
                  f"is slower (here ours takes {1 / nixl:.2f}× raw NIXL's time; it adds the hub, per-chunk plans and "
                  f"a checksum of every byte). Target ≥ {r['target']['ratio_vs_raw_nixl']}: "
                  f"{'met' if r['target_met'] else 'missed'}.", highlight=False, markup=False)


def render_bench_fanout(console: Console, r: dict) -> None:
    """The fan-out rows as a table, with the gloo broadcast where the rows carry it; with
    ``bound_s`` (testbed) also each time ÷ S/B."""
    bounded = "bound_s" in r["rows"][0]
    bcast = "broadcast_s" in r["rows"][0]
    cols = ["readers", "ours s", "star s"] + (["broadcast s"] if bcast else []) + ["star ÷ ours"] \
        + (["broadcast ÷ ours"] if bcast else []) + (["S/B s", "ours ÷ S/B", "star ÷ S/B"] if bounded else [])
    warm = ", warm" if r.get("warmup") else ""
    t = Grid(*cols, title=f"fan-out of {r['bytes'] / 2**20:.0f} MiB ({r['engine']}{warm}): targets "
             f"{'met' if r['target_met'] else 'missed'}")
    for row in r["rows"]:
        cells = [str(row["readers"]), f"{row['ours_s']:.2f}", f"{row['star_s']:.2f}"]
        cells += [f"{row['broadcast_s']:.2f}"] if bcast else []
        cells += [f"{row['star_vs_ours']:.2f}"] + ([f"{row['broadcast_vs_ours']:.2f}"] if bcast else [])
        if bounded:
            cells += [f"{row['bound_s']:.2f}", f"{row['ours_vs_bound']:.2f}", f"{row['star_vs_bound']:.2f}"]
        t.add_row(*cells)
    console.print(t)
    console.print("seconds until every reader has the version. star ÷ ours" + (", broadcast ÷ ours" if bcast else "")
                  + ": above 1 ours is faster." + (" S/B: bytes ÷ a node's link rate, the least any method can "
                                                     "take; ÷ S/B near 1 is the link's full rate." if bounded else ""),
                  highlight=False, markup=False)


def render_bench_rl(console: Console, r: dict) -> None:
    """Ours vs the workload's baseline, one column each (a row per measure, so it reads
    at 80 columns), with bytes per topology level; the stall ratio beside what ours gave
    for it (versions skipped, staleness)."""
    t = Grid("measure", "ours", "baseline", title=f"rl {r['workload']}", names=("measure",))
    arms = [r["ours"], r["baseline"]]

    def stale(a: dict) -> str:
        return "-" if a.get("mean_staleness") is None else f"{a['mean_staleness']:.2f}"

    rows = [("planner", lambda a: a["planner"]), ("rollouts", lambda a: str(a.get("rollouts", "in-place"))),
            ("rollout stall s", lambda a: f"{a['rollout_stall_s']:.2f}"),
            ("trainer stall s", lambda a: f"{a['trainer_stall_s']:.2f}"),
            ("versions loaded", lambda a: str(a["versions_loaded"])), ("mean staleness", stale)]
    rows += [(f"{lv} MB", lambda a, lv=lv: f"{a['bytes_by_level'][lv] / 1e6:.0f}")
             for lv in ("node", "rack", "dc", "remote")]
    rows += [("joins ← trainer MB", lambda a: f"{a['joiners_join_from_trainer_bytes'] / 1e6:.0f}")]
    for label, cell in rows:
        t.add_row(label, *(cell(a) for a in arms))
    console.print(t)
    console.print(f"rollout stall ratio {r['stall_ratio']} = baseline's rollout stall ÷ ours (above 1 ours stalls "
                  f"less); versions ours skipped {r.get('versions_skipped', 0)}; probe mismatches "
                  f"{r['probe_mismatches']} (a rollout ran weights not the trainer's: 0 is the only good value)",
                  highlight=False, markup=False)


def render_bench_faults(console: Console, result: dict) -> None:
    """One row per fault, numbers only; then the legend, then each row's detail as a
    line of its own (free text reads better wrapped than squeezed into a column)."""
    t = Grid("fault", "ok", "lost bytes", "recovery s", "slowdown",
             title=f"th bench faults ({result['bytes'] / 2**20:.0f} MiB, {result['engine']})", names=("fault",))

    def cell(v) -> str:
        return "yes" if v is True else "[red]NO[/]" if v is False else "-" if v is None else str(v)

    for row in result["rows"]:
        t.add_row(*(cell(row[c]) for c in ("fault", "ok", "lost_bytes", "recovery_s", "slowdown")))
    console.print(t)
    console.print(FAULTS_LEGEND, highlight=False, markup=False)
    for row in result["rows"]:
        console.print(f"{row['fault']}: {row['detail']}", highlight=False, markup=False)
    for fault, why in (result.get("skipped") or {}).items():
        console.print(f"{fault}: skipped: {why}", highlight=False, markup=False)
