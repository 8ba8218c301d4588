"""Rich renderings of hub status (tables only; no I/O beyond the console given).

The status screen: the hub line, nodes in the spec's order (a node without an agent,
e.g. after `th failover`, is listed as out of service with the command that brings it
back), endpoints, versions, and the hub's counters.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..hub import protocol as p
from ..launch.state import ClusterState


def _age(s: float) -> str:
    return f"{s:.1f}s"


def _running(value: bool | None) -> str:
    return "" if value else (" (unreachable)" if value is None else " (gone)")


def render_status(console: Console, state: ClusterState, status: p.StatusReply | None,
                  alive: dict[tuple[str, str], bool | None], places: dict[str, tuple[str, str]]) -> None:
    """``alive``: (role, node) → process running (None: cannot tell); ``places``: node →
    (rack, dc), in the spec's order."""
    for part in status_parts(state, status, alive, places):
        console.print(part)


def status_parts(state: ClusterState, status: p.StatusReply | None, alive: dict[tuple[str, str], bool | None],
                 places: dict[str, tuple[str, str]], endpoints: Table | None = None, counters: bool = True) -> list:
    """The status screen as renderables: hub line, nodes, endpoints (``endpoints``
    replaces the plain table, e.g. with the watch view's progress), versions and,
    with ``counters``, the hub's counters."""
    hub_rec = next((r for r in state.procs if r.role == "hub"), None)
    hub_line = f"[bold]{state.cluster}[/]  hub {state.hub_address}"
    if status is None:
        hub_line += "  [red]unreachable[/]"
    else:
        hub_line += f"  [green]up[/] {_age(status.uptime_s)}"
    if hub_rec is not None:
        hub_line += f"  pid {hub_rec.pid} on {hub_rec.node}" + _running(alive.get(("hub", hub_rec.node)))
    parts: list = [hub_line]

    seen = {e.name: e for e in status.endpoints} if status else {}
    nodes = Table("node", "rack", "dc", "agent", "alive", "heartbeat", "pid", title="nodes", title_justify="left")
    agents = {r.node: r for r in state.procs if r.role == "agent"}
    taken_out = []
    for node in [*places, *(n for n in agents if n not in places)]:  # the spec's order, not start order
        rec = agents.get(node)
        rack, dc = places.get(node, ("-", "-"))
        if rec is None:
            taken_out.append(node)
            nodes.add_row(node, rack, dc, "-", "[yellow]out of service[/]", "-", "-")
            continue
        ep = seen.get(f"agent-{rec.node}")
        ok = bool(ep and ep.alive)
        nodes.add_row(
            rec.node,
            rack,
            dc,
            f"agent-{rec.node}",
            "[green]yes[/]" if ok else "[red]no[/]",
            _age(ep.heartbeat_age_s) if ep else "-",
            f"{rec.pid}" + _running(alive.get(("agent", rec.node))),
        )
    parts.append(nodes)
    if taken_out:
        parts.append(f"out of service (no agent; `th failover` takes a node out): {', '.join(taken_out)}. "
                     "`th up SPEC` on the running cluster starts their agents again.")
    others = [e for e in (status.endpoints if status else []) if e.kind != "agent"]
    if endpoints is not None:
        parts.append(endpoints)
    elif others:
        eps = Table("endpoint", "node", "role", "alive", "heartbeat", "replicas", title="endpoints", title_justify="left")
        for e in others:
            eps.add_row(e.name, e.node, e.role, "yes" if e.alive else "no", _age(e.heartbeat_age_s), str(e.replicas))
        parts.append(eps)
    parts.append(versions_table(status.versions if status else []))
    if status is not None and counters:
        parts.append(counters_table(status.counters))
    return parts


def counters_table(counters: dict[str, float]):
    """The hub's counters (plans, bytes planned by level and tier, errors by kind, ...),
    bytes in MiB; the same numbers as ``--json`` and the Prometheus endpoint."""
    if not counters:
        return "hub counters: none yet"
    t = Table("counter", "value", title="hub counters", title_justify="left")
    for key, value in sorted(counters.items()):
        shown = f"{value / 2**20:.1f} MiB" if key.startswith("bytes") else f"{value:.0f}"
        t.add_row(key, shown)
    return t


def _names(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" +{len(names) - shown}" if len(names) > shown else "") or "-"


def render_versions(console: Console, versions: list[p.VersionStatus]) -> None:
    console.print(versions_table(versions))


def versions_table(versions: list[p.VersionStatus]):
    if not versions:
        return "versions: none yet"
    t = Table("model", "version", "state", "MiB", "chunks", "complete holders", "partial holders", "reliable copies",
              title="versions", title_justify="left")
    for col in t.columns[5:7]:
        col.overflow = "fold"  # endpoint names are the point of these columns: never cut them
    for v in versions:
        complete = [h.name for h in v.holders if h.complete]
        partial = [f"{h.name} {h.held_bytes / max(v.nbytes, 1):.0%}" for h in v.holders if not h.complete]
        t.add_row(v.model, str(v.version), v.state, f"{v.nbytes / 2**20:.1f}", str(v.chunks),
                  _names(complete), _names(partial), str(v.reliable_copies))
    return t


def render_bench_hub(console: Console, r: dict) -> None:
    t = Table("phase", "in flight", "ops/s", "plan p50 ms", "plan p99 ms", "hub CPU", "hub CPU s / version", title=(
        f"hub bench: {r['endpoints']} endpoints, target p99 ≤ {r['target']['plan_p99_ms']} ms and "
        f"≥ {r['target']['ops_per_s']} ops/s: {'met' if r['target_met'] else 'missed'}"), title_justify="left")
    for phase in ("throughput", "latency"):
        ph = r[phase]
        t.add_row(phase, str(ph["depth"]), f"{ph['ops_per_s']:.0f}", f"{ph['plan_p50_ms']:.2f}",
                  f"{ph['plan_p99_ms']:.2f}", f"{ph['hub_cpu_util']:.0%}", f"{ph['hub_cpu_s']:.2f}")
    console.print(t)


def render_bench_hub_replay(console: Console, r: dict) -> None:
    t = Table("version", "ops", "plans", "waits", "hub CPU s", "ops / CPU s", "plan µs", "plans digest", title=(
        f"hub replay: {r['endpoints']} endpoints, {r['planner']} planner, fixed schedule, no sockets"),
        title_justify="left")
    for key in ("v1", "v2"):
        ph = r[key]
        t.add_row(key, str(sum(ph["ops"].values())), str(ph["plans"]), str(ph["waits"]), f"{ph['hub_cpu_s']:.2f}",
                  f"{ph['ops_per_cpu_s']:.0f}", f"{ph['cpu_us'].get('plan', 0):.0f}", ph["plans_digest"])
    console.print(t)


def render_bench_fanout(console: Console, r: dict) -> None:
    """The fan-out rows as a table, with the gloo broadcast where the rows carry it; with
    ``bound_s`` (testbed) also each time ÷ S/B."""
    bounded = "bound_s" in r["rows"][0]
    bcast = "broadcast_s" in r["rows"][0]
    cols = ["readers", "ours s", "star s"] + (["broadcast s"] if bcast else []) + ["star ÷ ours"] \
        + (["broadcast ÷ ours"] if bcast else []) + (["S/B s", "ours ÷ S/B", "star ÷ S/B"] if bounded else [])
    warm = ", warm" if r.get("warmup") else ""
    t = Table(*cols, title=f"fan-out of {r['bytes'] / 2**20:.0f} MiB ({r['engine']}{warm}): targets "
              f"{'met' if r['target_met'] else 'missed'}", title_justify="left")
    for row in r["rows"]:
        cells = [str(row["readers"]), f"{row['ours_s']:.2f}", f"{row['star_s']:.2f}"]
        cells += [f"{row['broadcast_s']:.2f}"] if bcast else []
        cells += [f"{row['star_vs_ours']:.2f}"] + ([f"{row['broadcast_vs_ours']:.2f}"] if bcast else [])
        if bounded:
            cells += [f"{row['bound_s']:.2f}", f"{row['ours_vs_bound']:.2f}", f"{row['star_vs_bound']:.2f}"]
        t.add_row(*cells)
    console.print(t)


def render_bench_rl(console: Console, r: dict) -> None:
    """Ours vs the workload's baseline, side by side, with bytes per topology level; the
    stall ratio beside what ours gave for it (versions skipped, staleness)."""
    t = Table("arm", "planner", "rollouts", "rollout stall s", "trainer stall s", "versions loaded",
              "mean staleness", "node MB", "rack MB", "dc MB", "remote MB", "joins ← trainer MB",
              title=f"rl {r['workload']}: rollout stall ratio (baseline ÷ ours) {r['stall_ratio']}, "
              f"versions ours skipped {r.get('versions_skipped', 0)}, probe mismatches {r['probe_mismatches']}",
              title_justify="left")
    for arm in ("ours", "baseline"):
        a = r[arm]
        stale = a.get("mean_staleness")
        t.add_row(arm, a["planner"], a.get("rollouts", "in-place"), f"{a['rollout_stall_s']:.2f}",
                  f"{a['trainer_stall_s']:.2f}", str(a["versions_loaded"]),
                  "-" if stale is None else f"{stale:.2f}",
                  *(f"{a['bytes_by_level'][lv] / 1e6:.0f}" for lv in ("node", "rack", "dc", "remote")),
                  f"{a['joiners_join_from_trainer_bytes'] / 1e6:.0f}")
    console.print(t)
