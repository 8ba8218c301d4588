"""`th`'s read commands: ``status`` (and ``--watch``) and ``versions``, with what they
share: the running cluster (``load_running``) and one question to its hub
(``ask_hub``). ``cli`` registers them; like every command they parse, ask, print.
"""

from __future__ import annotations

import json
import time
from typing import Optional

import msgspec
import typer

from . import spec as specmod
from .ui.console import err, fail, out, plain

ClusterOpt = typer.Option(None, "-c", "--cluster", metavar="NAME",
                          help="cluster started by `th up` (default: the only/last one)")
JsonFlag = typer.Option(False, "--json", help="print one JSON document, for scripts")


def load_running(cluster: Optional[str]):
    from .launch.state import pick_cluster, read_state

    try:
        name = pick_cluster(cluster)
    except LookupError as exc:
        fail(exc.args[0], 2)
    state = read_state(name)
    if state is None:
        fail(f"cluster {name!r} is not running (start it with `th up FILE`)", 2)
    return name, state


def ask_hub(name: str, state, op, timeout: float = 3.0):
    """One request to the cluster's hub → (reply, None) or (None, the HubError/HubUnreachable)."""
    from .hub.client import HubClient, HubError, HubUnreachable
    from .launch.state import read_token

    client = HubClient(state.hub_address, read_token(name))
    try:
        return client.call(op, timeout=timeout), None
    except (HubUnreachable, HubError) as exc:
        return None, exc
    finally:
        client.close()


def status(cluster: Optional[str] = ClusterOpt, as_json: bool = JsonFlag,
           watch: bool = typer.Option(False, "--watch", help="refresh until Ctrl-C (redrawn in place on a terminal, "
                                      "one snapshot after another when piped)"),
           interval: float = typer.Option(1.0, min=0.2, metavar="SECONDS",
                                          help="--watch: seconds between refreshes")) -> None:
    """Hub, nodes (alive, rack, DC) in spec order, endpoints, versions and hub counters;
    --watch adds fetch progress (agents too) and events."""
    from .hub import protocol as p
    from .hub.client import HubUnreachable
    from .launch.cluster import processes_alive, proc_key
    from .launch.procs import endpoint_name
    from .launch.state import cluster_dir
    from .ui.status import hub_down_hint, render_status

    if watch and as_json:
        fail("--watch and --json do not go together (--json is one snapshot, for scripts)", 2)
    name, state = load_running(cluster)
    try:
        places = {n.name: (n.rack, n.dc) for n in specmod.load(cluster_dir(name) / "spec.yaml").nodes()}
    except specmod.SpecError:
        places = {}
    if watch:
        _watch(name, state, places, interval)
        return
    reply, problem = ask_hub(name, state, p.Status())
    alive = processes_alive(name, state)
    if as_json:
        doc = {
            "cluster": name,
            "hub": {"address": state.hub_address, "reachable": reply is not None, "error": plain(str(problem)) if problem else None,
                    "pid": state.procs[0].pid if state.procs else None},
            "processes": [{"role": r.role, "node": r.node, "name": endpoint_name(r),
                           "rack": places.get(r.node, ("", ""))[0], "dc": places.get(r.node, ("", ""))[1],
                           "pid": r.pid, "running": alive[proc_key(r)], "log": r.log} for r in state.procs],
            "status": msgspec.to_builtins(reply) if reply else None,
            # spec nodes without an agent (`th failover` took them out; `th up SPEC` brings them back)
            "out_of_service": [n for n in places if not any(r.role == "agent" and r.node == n for r in state.procs)],
        }
        print(json.dumps(doc, indent=2))
    else:
        render_status(out, state, reply, alive, places)
        if problem:
            err.print(f"hub: {plain(str(problem))}", markup=False, highlight=False, soft_wrap=True)
    if reply is None:
        if isinstance(problem, HubUnreachable):  # down, not a refusal (a wrong token says so above)
            err.print(f"th status: {hub_down_hint(state, alive, cluster_dir(name) / 'spec.yaml')}", markup=False,
                      highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _watch(name: str, state, places, interval: float) -> None:
    """Redrawn in place on a terminal; elsewhere (a pipe, a file) rich Live would show
    nothing until the end, so each refresh is printed whole after a timestamp line."""
    import contextlib

    from rich.live import Live

    from .hub import protocol as p
    from .launch.cluster import processes_alive
    from .ui.watch import Watch

    view = Watch()
    live = Live(console=out, auto_refresh=False, screen=False) if out.is_terminal else None
    try:
        with live or contextlib.nullcontext():
            while True:
                reply, problem = ask_hub(name, state, p.Status(), timeout=min(3.0, interval * 3))
                shown = view.render(time.monotonic(), state, reply, processes_alive(name, state), places)
                shown = shown if problem is None else _with_problem(shown, problem)
                if live is not None:
                    live.update(shown, refresh=True)
                else:
                    out.print(f"--- th status --watch -c {name}, {time.strftime('%H:%M:%S')} ---", highlight=False)
                    out.print(shown)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def _with_problem(shown, problem):
    from rich.console import Group
    from rich.text import Text

    return Group(shown, Text(f"hub: {plain(str(problem))}", style="red"))


def versions(model: Optional[str] = typer.Argument(None, help="only this model"), cluster: Optional[str] = ClusterOpt,
             as_json: bool = JsonFlag) -> None:
    """Versions the hub knows: state (STAGING, READY, UNAVAILABLE), size, who holds them,
    and why a copy stays (retention); a legend under the table says what each column means."""
    from .hub import protocol as p
    from .hub.client import HubUnreachable
    from .launch.state import cluster_dir
    from .ui.status import Retention, hub_down_hint, render_versions

    name, state = load_running(cluster)
    reply, problem = ask_hub(name, state, p.Versions(model=model))
    if reply is None and isinstance(problem, HubUnreachable):
        from .launch.cluster import processes_alive

        fail(f"{problem}: {hub_down_hint(state, processes_alive(name, state), cluster_dir(name) / 'spec.yaml')}", 1)
    if reply is None:
        fail(str(problem), 2 if getattr(problem, "code", None) == "not_found" else 1)
    if as_json:
        print(json.dumps(msgspec.to_builtins(reply.versions), indent=2))
        return
    try:
        declared = specmod.load(cluster_dir(name) / "spec.yaml").models
    except specmod.SpecError:
        declared = []
    render_versions(out, reply.versions, {m.name: Retention(m.retain.keep_latest, m.retain.min_reliable_copies)
                                          for m in declared})
