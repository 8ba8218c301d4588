"""Rich renderings of hub status (tables only; no I/O beyond the console given).

The status screen: the hub line, nodes in the spec's order (a node without an agent,
e.g. after `th failover`, is listed as out of service with the command that brings it
back), endpoints, versions, and the hub's counters. With the hub down (no reply) the
hub knows nothing to show: the screen says so and lists, instead of the hub's view,
every recorded process as the launcher sees it (running, gone, or its node not
answering), and ``hub_down_hint`` says what to do about it. Tables are ``tables.Grid``
(they read at 80 columns); ``th versions`` adds the legend of its columns
(``versions_legend``), with each model's retention policy from the running spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, NamedTuple

from rich.console import Console

from ..hub import protocol as p
from ..launch.procs import endpoint_name
from ..launch.state import ClusterState
from .tables import Grid, lines


class Retention(NamedTuple):
    keep_latest: int = 2
    min_reliable_copies: int = 1


def _age(s: float) -> str:
    return f"{s:.1f}s"


def _running(value: bool | None) -> str:
    return "" if value else (" (unreachable)" if value is None else " (gone)")


def _process(value: bool | None) -> str:
    return "[green]running[/]" if value else ("[yellow]node unreachable[/]" if value is None else "[red]gone[/]")


def render_status(console: Console, state: ClusterState, status: p.StatusReply | None,
                  alive: dict[tuple[str, str], bool | None], places: dict[str, tuple[str, str]]) -> None:
    """``alive``: (role, node) → process running (None: cannot tell); ``places``: node →
    (rack, dc), in the spec's order."""
    for part in status_parts(state, status, alive, places):
        console.print(part)


def status_parts(state: ClusterState, status: p.StatusReply | None, alive: dict[tuple[str, str], bool | None],
                 places: dict[str, tuple[str, str]], endpoints: Grid | None = None, counters: bool = True) -> list:
    """The status screen as renderables: hub line, nodes, endpoints (``endpoints``
    replaces the plain table, e.g. with the watch view's progress), versions and,
    with ``counters``, the hub's counters. Without a ``status`` (the hub is down):
    hub line, the recorded processes, and why versions are not shown."""
    from ..launch.cluster import proc_key

    hub_rec = next((r for r in state.procs if r.role == "hub"), None)
    hub_line = f"[bold]{state.cluster}[/]  hub {state.hub_address}"
    if status is None:
        hub_line += "  [red]down (no reply)[/]"
    else:
        hub_line += f"  [green]up[/] {_age(status.uptime_s)}"
    if hub_rec is not None:
        hub_line += f"  pid {hub_rec.pid} on {hub_rec.node}" + _running(alive.get(("hub", hub_rec.node)))
    parts: list = [hub_line]
    agents = {r.node: r for r in state.procs if r.role == "agent"}
    order = [*places, *(n for n in agents if n not in places)]  # the spec's order, not start order
    taken_out = [n for n in order if n not in agents]
    if status is None:
        procs = Grid("node", "rack", "dc", "process", "pid", "state", names=("node", "process"),
                     title="processes (the launcher's view)")
        runners = sorted((r for r in state.procs if r.role not in ("hub", "agent")), key=endpoint_name)
        for node in order:
            rack, dc = places.get(node, ("-", "-"))
            if node not in agents:
                procs.add_row(node, rack, dc, "-", "-", "[yellow]out of service[/]")
                continue
            for rec in [agents[node], *(r for r in runners if r.node == node)]:
                procs.add_row(node, rack, dc, endpoint_name(rec), str(rec.pid), _process(alive.get(proc_key(rec))))
        parts.append(procs)
        parts.append("versions: not known while the hub is down (agents and runners keep their copies and "
                     "register them again once it is back)")
        return parts

    seen = {e.name: e for e in status.endpoints}
    nodes = Grid("node", "rack", "dc", "agent", "alive", "heartbeat", "pid", title="nodes", names=("node", "agent"))
    for node in order:
        rec = agents.get(node)
        rack, dc = places.get(node, ("-", "-"))
        if rec is None:
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
    others = [e for e in status.endpoints if e.kind != "agent"]
    if endpoints is not None:
        parts.append(endpoints)
    elif others:
        eps = Grid("endpoint", "node", "role", "alive", "heartbeat", "replicas", title="endpoints",
                   names=("endpoint", "node"))
        for e in others:
            eps.add_row(e.name, e.node, e.role, "yes" if e.alive else "no", _age(e.heartbeat_age_s), str(e.replicas))
        parts.append(eps)
    parts.append(versions_table(status.versions))
    if counters:
        parts.append(counters_table(status.counters))
    return parts


def hub_down_hint(state: ClusterState, alive: dict[tuple[str, str], bool | None], spec_copy: Path) -> str:
    """What an operator does about a hub that does not answer, by what its process does."""
    hub_rec = next((r for r in state.procs if r.role == "hub"), None)
    running = alive.get(("hub", hub_rec.node)) if hub_rec else False
    up = (f"`th up SPEC` restarts it and leaves what runs alone (SPEC: the spec the cluster runs; a copy is "
          f"{spec_copy})")
    if running is None:
        return (f"the hub does not answer and its node {hub_rec.node} does not either: once the node is back, "
                f"{up}")
    if running:
        return (f"the hub's process (pid {hub_rec.pid} on {hub_rec.node}) runs but does not answer: see `th logs hub`; "
                f"if it stays so, `th down -c {state.cluster}` then `th up SPEC`")
    return f"the hub is down (its process is gone): {up}"


def counters_table(counters: dict[str, float]):
    """The hub's counters (plans, bytes planned by level and tier, errors by kind, ...),
    bytes in MiB; the same numbers as ``--json`` and the Prometheus endpoint."""
    if not counters:
        return "hub counters: none yet"
    t = Grid("counter", "value", title="hub counters", names=("counter",))
    for key, value in sorted(counters.items()):
        shown = f"{value / 2**20:.1f} MiB" if key.startswith("bytes") else f"{value:.0f}"
        t.add_row(key, shown)
    return t


def render_versions(console: Console, versions: list[p.VersionStatus],
                    policies: Mapping[str, Retention] | None = None) -> None:
    """The versions table and, when there is one, the legend of its columns with each
    model's retention policy (``policies``: model → policy; others get the default)."""
    console.print(versions_table(versions, policies or {}))
    if versions:
        console.print(versions_legend(versions, policies or {}), highlight=False, markup=False)


def _retained(versions: list[p.VersionStatus], policies: Mapping[str, Retention]) -> set[tuple[str, int]]:
    """Per model the keep_latest newest versions that were READY (as the hub lists them:
    a version `th unpublish` withdrew is no longer listed)."""
    kept: set[tuple[str, int]] = set()
    for model in {v.model for v in versions}:
        ready = sorted((v.version for v in versions if v.model == model and v.state in ("READY", "UNAVAILABLE")),
                       reverse=True)
        kept |= {(model, n) for n in ready[: policies.get(model, Retention()).keep_latest]}
    return kept


def versions_table(versions: list[p.VersionStatus], policies: Mapping[str, Retention] | None = None):
    if not versions:
        return "versions: none yet"
    policies = policies or {}
    kept = _retained(versions, policies)
    t = Grid("model", "version", "state", "MiB", "holders", "reliable", "retained", title="versions",
             names=("model", "holders"))
    for v in versions:
        held = [h.name + (" (spot)" if not h.reliable else "") + (" (draining)" if h.draining else "")
                for h in v.holders if h.complete]
        held += [f"{h.name} {h.held_bytes / max(v.nbytes, 1):.0%}" for h in v.holders if not h.complete]
        retained = (v.model, v.version) in kept
        minimum = policies.get(v.model, Retention()).min_reliable_copies
        t.add_row(v.model, str(v.version), v.state, f"{v.nbytes / 2**20:.1f}", lines(held, 6),
                  f"{v.reliable_copies}/{minimum}" if retained else str(v.reliable_copies),
                  "yes" if retained else "no")
    return t


def versions_legend(versions: list[p.VersionStatus], policies: Mapping[str, Retention]) -> str:
    """What the versions table's columns mean, and each listed model's policy."""
    models = sorted({v.model for v in versions})
    policy = "; ".join(f"{m}: keep_latest {policies.get(m, Retention()).keep_latest}, min_reliable_copies "
                       f"{policies.get(m, Retention()).min_reliable_copies}" for m in models)
    return (
        "holders: who holds a copy (a partial one: how much of it). agent-NODE is NODE's agent, a host-memory copy "
        "(`th publish`, `th sync --role agent`, or a retention pull).\n"
        "reliable: complete copies on reliable endpoints (not spot ones), / the minimum retention keeps for a "
        "retained version.\n"
        "retained: one of the model's keep_latest newest versions. Retention keeps its agents' copies and has an "
        "agent pull one when fewer than min_reliable_copies are left; a version past keep_latest loses its agents' "
        "copies once nobody reads it. Any other holder keeps its copy until it unpublishes it (`th unpublish`).\n"
        f"retention (the spec's models[].retain): {policy}")
