"""`th`: the command line. Commands parse, call one module, print; no logic lives here.

Exit codes: 0 ok; 1 the operation failed (hub unreachable, start-up timed out);
2 bad input (spec problems, unknown cluster, node or role).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import msgspec
import typer
from rich.console import Console
from typer.core import TyperGroup

from . import spec as specmod

app = typer.Typer(add_completion=False, no_args_is_help=True, help="TensorHub: move LLM weights by reference.")
spec_app = typer.Typer(no_args_is_help=True, help="Check a cluster spec or print its JSON Schema.")
app.add_typer(spec_app, name="spec")
out = Console()
err = Console(stderr=True)

ClusterOpt = typer.Option(None, "-c", "--cluster", help="cluster started by `th up` (default: the only/last one)")


def fail(message: str, code: int) -> None:
    typer.echo(message, err=True)  # plain: problem lines must not be wrapped or styled
    raise typer.Exit(code)


@spec_app.command("check")
def spec_check(file: Path = typer.Argument(..., help="cluster YAML")) -> None:
    """Validate FILE; print one `path.to.field: message` line per problem."""
    try:
        s = specmod.load(file)
    except specmod.SpecError as exc:
        fail("\n".join(exc.lines), 2)
    out.print(f"{file}: ok — cluster {s.name!r}, {len(s.nodes())} nodes, launcher {s.launcher}", highlight=False)


@spec_app.command("schema")
def spec_schema() -> None:
    """Print the cluster spec's JSON Schema."""
    print(json.dumps(specmod.schema(), indent=2))


@app.command()
def up(file: Path = typer.Argument(..., help="cluster YAML"),
       timeout: float = typer.Option(30.0, help="seconds to wait for every agent to register")) -> None:
    """Start the hub and one agent per node, and wait until all have registered.

    On a running cluster (same spec): restart what died, leave what lives."""
    from .launch.cluster import AlreadyRunning, ReconcileError, Reconciled, SpecChanged, UpError, up as do_up
    from .launch.state import StateError

    try:
        s = specmod.load(file)
    except specmod.SpecError as exc:
        fail("\n".join(exc.lines), 2)
    try:
        state = do_up(s, file, timeout=timeout, log=lambda line: out.print(line, highlight=False, markup=False))
    except AlreadyRunning as exc:
        out.print(f"{exc}; nothing changed", highlight=False, markup=False)
        return
    except SpecChanged as exc:
        fail(f"th up: {exc}", 2)
    except StateError as exc:
        fail(f"th up: {exc}", 1)
    except ReconcileError as exc:
        fail(f"th up: {exc}\n(what was running was left running; what was restarted stays recorded: "
             f"`th up` again retries the rest, `th down -c {s.name}` stops it all)", 1)
    except UpError as exc:
        fail(f"th up: {exc}\n(everything started was stopped again)", 1)
    if isinstance(state, Reconciled):
        out.print(f"cluster {s.name!r} reconciled: restarted {', '.join(state.restarted)}; "
                  f"left {', '.join(state.left) or 'nothing'} running", highlight=False, markup=False,
                  soft_wrap=True)
        return
    out.print(f"cluster {state.cluster!r} is up: {len(state.procs) - 1} agents registered with {state.hub_address}",
              highlight=False)


@app.command()
def down(cluster: Optional[str] = ClusterOpt,
         forget: bool = typer.Option(False, "--forget", help="drop the record even if some nodes cannot be reached "
                                     "(their processes, if any, keep running)")) -> None:
    """Stop every process `th up` started for the cluster (by recorded PID, if still ours)."""
    from .launch.cluster import down as do_down
    from .launch.state import clear_state, pick_cluster

    try:
        name = pick_cluster(cluster)
        results = do_down(name, log=lambda line: out.print(line, highlight=False))
    except LookupError as exc:
        fail(f"th down: {exc.args[0]}", 2)
    unknown = [f"{role}@{node}" for role, node, outcome in results if outcome.startswith("unknown")]
    if unknown and forget:
        clear_state(name)
        out.print(f"forgot {', '.join(unknown)}: not stopped")
    elif unknown:
        fail(f"th down: could not stop {', '.join(unknown)} (unreachable, or the signal was refused: see above); "
             f"their state is kept: run `th down -c {name}` again "
             "(or add --forget if those nodes are gone for good)", 1)
    out.print(f"cluster {name!r} is down")


def _load_running(cluster: Optional[str]):
    from .launch.state import pick_cluster, read_state

    try:
        name = pick_cluster(cluster)
    except LookupError as exc:
        fail(f"th: {exc.args[0]}", 2)
    state = read_state(name)
    if state is None:
        fail(f"th: cluster {name!r} is not running", 2)
    return name, state


def _ask_hub(name: str, state, op, timeout: float = 3.0):
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


@app.command()
def status(cluster: Optional[str] = ClusterOpt, as_json: bool = typer.Option(False, "--json"),
           watch: bool = typer.Option(False, "--watch", help="refresh until Ctrl-C (rich Live)"),
           interval: float = typer.Option(1.0, min=0.2, help="--watch: seconds between refreshes")) -> None:
    """Hub, nodes (alive, rack, DC), endpoints and versions; --watch adds fetch progress and events."""
    from .hub import protocol as p
    from .launch.cluster import processes_alive, proc_key
    from .launch.procs import endpoint_name
    from .launch.state import cluster_dir
    from .ui.status import render_status

    if watch and as_json:
        fail("th status: --watch and --json do not go together (--json is one snapshot, for scripts)", 2)
    name, state = _load_running(cluster)
    try:
        places = {n.name: (n.rack, n.dc) for n in specmod.load(cluster_dir(name) / "spec.yaml").nodes()}
    except specmod.SpecError:
        places = {}
    if watch:
        _watch(name, state, places, interval)
        return
    reply, problem = _ask_hub(name, state, p.Status())
    alive = processes_alive(name, state)
    if as_json:
        doc = {
            "cluster": name,
            "hub": {"address": state.hub_address, "reachable": reply is not None, "error": str(problem) if problem else None,
                    "pid": state.procs[0].pid if state.procs else None},
            "processes": [{"role": r.role, "node": r.node, "name": endpoint_name(r),
                           "rack": places.get(r.node, ("", ""))[0], "dc": places.get(r.node, ("", ""))[1],
                           "pid": r.pid, "running": alive[proc_key(r)], "log": r.log} for r in state.procs],
            "status": msgspec.to_builtins(reply) if reply else None,
        }
        print(json.dumps(doc, indent=2))
    else:
        render_status(out, state, reply, alive, places)
        if problem:
            err.print(f"hub: {problem}", markup=False)
    if reply is None:
        raise typer.Exit(1)


def _watch(name: str, state, places, interval: float) -> None:
    from rich.live import Live

    from .hub import protocol as p
    from .launch.cluster import processes_alive
    from .ui.watch import Watch

    view = Watch()
    try:
        with Live(console=out, auto_refresh=False, screen=False) as live:
            while True:
                reply, problem = _ask_hub(name, state, p.Status(), timeout=min(3.0, interval * 3))
                shown = view.render(time.monotonic(), state, reply, processes_alive(name, state), places)
                live.update(shown if problem is None else _with_problem(shown, problem), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def _with_problem(shown, problem):
    from rich.console import Group
    from rich.text import Text

    return Group(shown, Text(f"hub: {problem}", style="red"))


@app.command()
def versions(model: Optional[str] = typer.Argument(None, help="only this model"), cluster: Optional[str] = ClusterOpt,
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Versions the hub knows: state (STAGING, READY, UNAVAILABLE), size, replicas."""
    from .hub import protocol as p
    from .ui.status import render_versions

    name, state = _load_running(cluster)
    reply, problem = _ask_hub(name, state, p.Versions(model=model))
    if reply is None:
        fail(f"th versions: {problem}", 2 if getattr(problem, "code", None) == "not_found" else 1)
    if as_json:
        print(json.dumps(msgspec.to_builtins(reply.versions), indent=2))
    else:
        render_versions(out, reply.versions)


def _hub_client(name: str, state):
    from .hub.client import HubClient
    from .launch.state import read_token

    return HubClient(state.hub_address, read_token(name))


@app.command()
def publish(model: str = typer.Argument(..., help="model name, e.g. policy"),
            source: Path = typer.Option(..., "--from", help="a .safetensors checkpoint (a path on that node)"),
            version: Optional[int] = typer.Option(None, "--version", min=1, help="default: the newest known + 1"),
            node: Optional[str] = typer.Option(None, "--node", help="whose agent holds it (default: the hub's node)"),
            cluster: Optional[str] = ClusterOpt, timeout: float = typer.Option(300.0, min=1)) -> None:
    """Load a checkpoint into a node's agent (host memory) and publish it as a version."""
    from .launch import operate
    from .launch.state import cluster_dir

    name, state = _load_running(cluster)
    spec = specmod.load(cluster_dir(name) / "spec.yaml")
    node = node or spec.hub.node
    if node not in {n.name for n in spec.nodes()}:
        fail(f"th publish: --node {node!r} is not in cluster {name!r} "
             f"(nodes: {', '.join(n.name for n in spec.nodes())})", 2)
    m = spec.model(model)
    client = _hub_client(name, state)
    try:
        if spec.launcher == "local":  # the agent shares our file system: check before asking it
            operate.check_checkpoint(source)
        number = version or operate.next_version(client, model)
        chunk = int((m.chunk_mb if m else 16) * 2**20)
        v = operate.publish_file(client, node, model, str(source.resolve() if spec.launcher == "local" else source),
                                 number, chunk, timeout,
                                 log=lambda line: err.print(f"th publish: {line}", highlight=False, markup=False))
    except operate.OperateError as exc:
        fail(f"th publish: {exc}", exc.code)
    finally:
        client.close()
    out.print(f"published {model}@{v.version} from {source} on {node}: {v.nbytes / 2**20:.1f} MiB in {v.chunks} chunks")


@app.command()
def sync(model: str = typer.Argument(..., help="model name"),
         version: str = typer.Option("latest", "--version", help="N or latest"),
         role: Optional[str] = typer.Option(None, "--role", help="every endpoint of this role fetches"),
         node: Optional[str] = typer.Option(None, "--node", help="every endpoint on this node fetches"),
         cluster: Optional[str] = ClusterOpt, timeout: float = typer.Option(600.0, min=1),
         as_json: bool = typer.Option(False, "--json", help="print the outcome as JSON, no progress bars")) -> None:
    """Have the target endpoints fetch a version; live progress per endpoint."""
    from .launch import operate
    from .ui.sync import SyncView

    if (role is None) == (node is None):
        fail("th sync: give exactly one of --role ROLE or --node NODE", 2)
    if version != "latest" and not version.isdigit():
        fail(f"th sync: --version must be a number or 'latest', got {version!r}", 2)
    name, state = _load_running(cluster)
    client = _hub_client(name, state)

    def log(line: str) -> None:
        err.print(f"th sync: {line}", highlight=False, markup=False)

    try:
        if as_json:
            run = operate.sync(client, model, None if version == "latest" else int(version), role, node, timeout,
                               log=log)
        else:
            with SyncView(err) as view:
                run = operate.sync(client, model, None if version == "latest" else int(version), role, node,
                                   timeout, view.update, log=log)
    except operate.OperateError as exc:
        fail(f"th sync: {exc}", exc.code)
    finally:
        client.close()
    failed = {n: t.failed for n, t in run.targets.items() if t.failed}
    if as_json:
        print(json.dumps({"model": model, "version": run.version, "nbytes": run.nbytes,
                          "targets": {n: {"done": t.done, "failed": t.failed} for n, t in run.targets.items()}}))
    if failed:
        fail("th sync: failed on " + "; ".join(f"{n}: {why}" for n, why in sorted(failed.items())), 1)
    if not as_json:
        out.print(f"synced {model}@{run.version} to {len(run.targets)} endpoint(s)")


class _Workloads(TyperGroup):
    # An unknown workload is bad input like any other here: one plain line, exit 2.
    def resolve_command(self, ctx, args):
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            fail(f"th bench: unknown workload {args[0]!r} (known: {', '.join(self.commands)})", 2)
        return super().resolve_command(ctx, args)


bench = typer.Typer(cls=_Workloads, no_args_is_help=True,
                    help="Measure a workload and print JSON (ratios and latencies measured in one run).")
app.add_typer(bench, name="bench")

JsonOpt = typer.Option(False, "--json", help="print only the JSON result")
PlotOpt = typer.Option(None, "--plot", help="write a PNG chart")
EngineOpt = typer.Option("nixl", help="nixl or tcp")
TimeoutOpt = typer.Option(600.0, min=1, help="seconds before a phase counts as stuck")


def _check_engine(workload: str, engine: str) -> None:
    if engine not in ("nixl", "tcp"):
        fail(f"th bench {workload}: --engine must be nixl or tcp, got {engine!r}", 2)


def _reader_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1 or counts[-1] > 64:
        fail(f"th bench fanout: --readers must be a comma list of counts in 1..64, got {text!r}", 2)
    return counts


@bench.command("hub")
def bench_hub(as_json: bool = JsonOpt,
              endpoints: int = typer.Option(1000, min=2, help="simulated endpoints"),
              tensors: int = typer.Option(1000, min=1, help="tensors per manifest"),
              chunk_mb: int = typer.Option(64, min=1, help="chunk size in MiB"),
              depth: int = typer.Option(64, min=1, help="requests in flight in the throughput phase"),
              planner: str = typer.Option("ros", help="ros, or star (the all-from-publisher baseline)"),
              timeout: float = TimeoutOpt,
              profile: Optional[Path] = typer.Option(None, help="write a cProfile of the hub process here")) -> None:
    """Real hub on one core under N simulated endpoints: plan latency and control ops/s."""
    if planner not in ("ros", "star"):
        fail(f"th bench hub: --planner must be ros or star, got {planner!r}", 2)
    from .bench import hub as hub_bench

    if not as_json:
        err.print(f"bench hub: {endpoints} endpoints, {tensors}-tensor manifests, hub pinned to one core …",
                  highlight=False)
    try:
        result = hub_bench.run(endpoints=endpoints, tensors=tensors, chunk_mb=chunk_mb, depth=depth,
                               planner=planner, timeout_s=timeout, profile=profile)
    except hub_bench.BenchError as exc:
        fail(f"th bench hub: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        from .ui.status import render_bench_hub

        render_bench_hub(err, result)


@bench.command("p2p")
def bench_p2p(as_json: bool = JsonOpt,
              mib: float = typer.Option(256, min=0.001, help="payload MiB"),
              reps: int = typer.Option(3, min=1, help="repetitions (medians are reported)"),
              window: int = typer.Option(4, min=1, help="reads in flight"),
              engine: str = EngineOpt) -> None:
    """One fetch through our endpoint vs raw NIXL READ vs raw TCP, between the same two processes."""
    _check_engine("p2p", engine)
    from .bench import p2p
    from .bench.rig import RigError

    if not as_json:
        err.print("bench p2p: starting processes on loopback …", highlight=False)
    try:
        result = p2p.run(mib=mib, reps=reps, window=window, engine=engine)
    except (RigError, RuntimeError, ValueError) as exc:
        fail(f"th bench p2p: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))


@bench.command("fanout")
def bench_fanout(as_json: bool = JsonOpt, plot: Optional[Path] = PlotOpt,
                 mib: float = typer.Option(128, min=0.001, help="payload MiB"),
                 readers: Optional[str] = typer.Option(None, help="reader counts, a comma list "
                                                       "(default 1,2,4,8; 1,3,7 with --testbed)"),
                 window: Optional[int] = typer.Option(None, min=1, help="reads in flight per reader "
                                                      "(default 2; 4 with --testbed)"),
                 engine: str = EngineOpt,
                 testbed: bool = typer.Option(False, "--testbed", help="on an 8-node namespace testbed it builds "
                                              "and removes (root)"),
                 node_gbps: Optional[float] = typer.Option(None, min=0.001, help="--testbed: node link rate")) -> None:
    """One publisher, N readers fetching the same version at once: ours vs trainer-star."""
    _check_engine("fanout", engine)
    # Checked before anything starts: inside the try below, typer.Exit (a RuntimeError) would turn into exit 1.
    counts = _reader_counts(readers or ("1,3,7" if testbed else "1,2,4,8"))
    from .bench import fanout
    from .bench.rig import RigError

    if not as_json:
        where = "an 8-node testbed (built now, removed after)" if testbed else "loopback"
        err.print(f"bench fanout: starting processes on {where} …", highlight=False)
    try:
        if testbed:
            result = fanout.run_testbed(counts, mib=mib, window=4 if window is None else window, engine=engine,
                                        node_gbps=node_gbps)
        else:
            result = fanout.run(counts, mib=mib, window=2 if window is None else window, engine=engine)
    except (RigError, RuntimeError, ValueError) as exc:
        fail(f"th bench fanout: {exc}", 1)
    _show_bench("fanout", result, as_json, plot)


@bench.command("faults")
def bench_faults(as_json: bool = JsonOpt,
                 mib: float = typer.Option(64, min=0.001, help="payload MiB of each faulted fetch"),
                 engine: str = typer.Option("tcp", help="nixl or tcp (tcp: its serving can be throttled so "
                                            "that faults land mid-read)"),
                 window: int = typer.Option(2, min=1, help="reads in flight per reader"),
                 timeout: float = typer.Option(120.0, min=1, help="seconds before an operation counts as stuck")) -> None:
    """Kill sources, readers and the hub, corrupt chunks, send bad tokens and garbage mid-fetch: one row per fault."""
    _check_engine("faults", engine)
    from .bench import faults
    from .bench.rig import RigError

    if not as_json:
        err.print(f"bench faults: {', '.join(faults.FAULTS)} on loopback …", highlight=False)
    try:
        result = faults.run(mib=mib, engine=engine, timeout=timeout, window=window)
    except (RigError, RuntimeError, OSError, ValueError) as exc:
        fail(f"th bench faults: {exc}", 1)
    if as_json:
        print(json.dumps({"rows": result["rows"], "ok": result["ok"]}))
    else:
        from rich.table import Table

        table = Table(title=f"th bench faults ({result['bytes'] / 2**20:.0f} MiB, {result['engine']})")
        for col in ("fault", "ok", "lost_bytes", "recovery_s", "slowdown", "detail"):
            table.add_column(col, overflow="fold")
        for row in result["rows"]:
            table.add_row(*("yes" if v is True else "NO" if v is False else "-" if v is None else str(v)
                            for v in (row[c] for c in ("fault", "ok", "lost_bytes", "recovery_s", "slowdown",
                                                         "detail"))))
        out.print(table)
    if not result["ok"]:
        fail("th bench faults: " + "; ".join(f"{r['fault']}: {r['detail']}" for r in result["rows"] if not r["ok"]), 1)


@bench.command("rl")
def bench_rl(as_json: bool = JsonOpt, plot: Optional[Path] = PlotOpt,
             workload: str = typer.Option("standalone", "--workload", help="standalone, elastic or cross-dc"),
             steps: int = typer.Option(4, min=1, help="trainer steps (= versions)"),
             rollouts: int = typer.Option(3, min=1, max=16, help="rollout runners"),
             hidden: int = typer.Option(512, min=16, help="model hidden size"),
             layers: int = typer.Option(8, min=1, help="model layers"),
             step_s: float = typer.Option(1.5, min=0, help="the trainer's pace, seconds per step at least"),
             engine: str = EngineOpt, timeout: float = TimeoutOpt,
             testbed: bool = typer.Option(False, "--testbed", help="on an 8-node namespace testbed it builds and "
                                          "removes (root)")) -> None:
    """An RL workload (trainer + rollouts), ours then its baseline, in one run."""
    from .bench import rl
    from .bench.rig import RigError

    if workload not in rl.WORKLOADS:
        fail(f"th bench rl: --workload must be one of {', '.join(rl.WORKLOADS)}, got {workload!r}", 2)
    _check_engine("rl", engine)
    if hidden % 8:
        fail(f"th bench rl: --hidden must be a multiple of 8 (8 heads), got {hidden}", 2)
    if not as_json:
        where = "an 8-node testbed (built now, removed after)" if testbed else "loopback"
        err.print(f"bench rl {workload}: trainer + rollouts on {where}, ours then baseline …", highlight=False)
    knobs = rl.Knobs(steps=steps, rollouts=rollouts, hidden=hidden, layers=layers, step_s=step_s, engine=engine,
                     timeout_s=timeout)
    try:
        result = rl.run(workload, knobs, on_testbed=testbed)
    except (RigError, RuntimeError, OSError, ValueError) as exc:
        fail(f"th bench rl: {exc}", 1)
    _show_bench("rl", result, as_json, plot)
    if result["probe_mismatches"]:
        fail(f"th bench rl: {result['probe_mismatches']} probe mismatch(es): a rollout ran weights that were "
             "not the trainer's version", 1)


def _show_bench(workload: str, result: dict, as_json: bool, plot: Optional[Path]) -> None:
    """JSON on stdout; without --json a table on stderr; with --plot a PNG
    (``ui.status.render_bench_<workload>``, ``ui.plot.<workload>``)."""
    from .ui import plot as charts
    from .ui import status as tables

    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        getattr(tables, f"render_bench_{workload}")(err, result)
    if plot is not None:
        try:
            getattr(charts, workload)(result, plot)
        except charts.PlotUnavailable as exc:
            fail(f"th bench {workload}: {exc}", 1)
        err.print(f"wrote {plot}", highlight=False)


@app.command()
def logs(node: str = typer.Argument(..., help="node name, or 'hub'"), cluster: Optional[str] = ClusterOpt,
         follow: bool = typer.Option(False, "--follow", "-f"), lines: int = typer.Option(50, "-n", min=0)) -> None:
    """Print (or follow) the logs of the processes on NODE (over ssh for ssh clusters)."""
    from .launch.cluster import logs as node_logs
    from .launch.ssh import SshError

    name, state = _load_running(cluster)
    try:
        node_logs(name, state, node, lines, follow, lambda text: print(text, end="", flush=True))
    except LookupError as exc:
        fail(f"th logs: {exc.args[0]}", 2)
    except SshError as exc:
        fail(f"th logs: {exc}", 1)
    except KeyboardInterrupt:
        pass


def _operate(cluster: Optional[str], as_json: bool, action) -> None:
    from .launch.scale import BadInput, ScaleError, run

    name, state = _load_running(cluster)
    try:
        outcome = run(name, state, action, log=(lambda *_: None) if as_json else
                      (lambda line: err.print(line, highlight=False, markup=False)))
    except ScaleError as exc:
        fail(f"th: {exc}", 2 if isinstance(exc, BadInput) else 1)
    if as_json:
        print(json.dumps(outcome.as_dict()))
    else:
        for what in ("stopped", "drained", "started"):
            names = getattr(outcome, what)
            out.print(f"{what}: {', '.join(names) if names else '-'}", highlight=False)


@app.command()
def scale(change: str = typer.Argument(..., help="ROLE=COUNT, ROLE+N or ROLE-N, e.g. rollout=4"),
          cluster: Optional[str] = ClusterOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Start or stop runners of a role on nodes with room; leavers unpublish with drain (and retention)."""
    _operate(cluster, as_json, lambda op: op.scale(change))


@app.command()
def failover(node: str = typer.Argument(..., help="the node to take out of service"),
             replace_with: Optional[str] = typer.Option(None, "--replace-with", help="where its runners go"),
             cluster: Optional[str] = ClusterOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Drain NODE's replicas (retention first), stop its runners and agent, start the runners elsewhere."""
    _operate(cluster, as_json, lambda op: op.failover(node, replace_with))


def main() -> None:
    from .launch.state import StateError

    try:
        app(prog_name="th")
    except StateError as exc:  # a corrupt state.json, whichever command read it: one line naming the file
        typer.echo(f"th: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
