"""`th`: the command line. Commands parse, call one module, print; no logic lives here.

Exit codes: 0 ok; 1 the operation failed (hub unreachable, start-up timed out);
2 bad input (spec problems, unknown cluster, node or role). Every problem is reported
through ``ui.console.fail`` as ``th COMMAND: message`` (spec problems as the
``path.to.field: message`` lines `th spec check` lists); results go to stdout,
progress to stderr or, for `th up`/`th down`, stdout (``-q`` silences progress).
Help follows ``ui.helpstyle``; ``th bench`` lives in ``bench/cli.py``, the read commands
(status, versions) in ``cli_views.py``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from . import spec as specmod
from .bench.cli import bench
from .cli_views import ClusterOpt, JsonFlag, load_running, status, versions
from .ui.console import entered, err, fail, out, set_quiet, step
from .ui.helpstyle import ThGroup

app = typer.Typer(cls=ThGroup, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                  help="TensorHub: move LLM weights by reference.")
spec_app = typer.Typer(cls=ThGroup, no_args_is_help=True, help="Check a cluster spec or print its JSON Schema.")
app.add_typer(spec_app, name="spec")
app.add_typer(bench, name="bench")



def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        from . import __version__

        try:
            number = version("tensorhub-ros")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            number = __version__
        typer.echo(f"th (tensorhub-ros) {number}")
        raise typer.Exit(0)


@app.callback()
def _th(ctx: typer.Context,
        quiet: bool = typer.Option(False, "-q", "--quiet", help="no progress lines: results and errors only"),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="NIXL's and UCX's own log lines too, in a "
                                     "terminal (TH_VERBOSE=1 for the processes th starts; logs always keep them)"),
        version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                     help="print the version and exit")) -> None:
    set_quiet(quiet)
    if verbose:
        import os

        os.environ["TH_VERBOSE"] = "1"  # (engines.nixl_shim: what this process starts inherits it)
    entered([ctx.invoked_subcommand or ""], reset=True)


@spec_app.callback()
def _spec(ctx: typer.Context) -> None:
    entered([ctx.invoked_subcommand or ""])


def spec_problems(lines: list[str]) -> None:
    """A spec that does not validate: its problems as `th spec check` lists them
    (``path.to.field: message (line N)``, one a line, nothing before the path), exit 2."""
    typer.echo("\n".join(lines), err=True)
    raise typer.Exit(2)


@spec_app.command("check")
def spec_check(file: Path = typer.Argument(..., help="cluster YAML")) -> None:
    """Validate FILE; print one `path.to.field: message` line per problem."""
    try:
        s = specmod.load(file)
    except specmod.SpecError as exc:
        spec_problems(exc.lines)
    out.print(f"{file}: ok — cluster {s.name!r}, {len(s.nodes())} nodes, launcher {s.launcher}", highlight=False)


@spec_app.command("schema")
def spec_schema() -> None:
    """Print the cluster spec's JSON Schema."""
    print(json.dumps(specmod.schema(), indent=2))


@app.command()
def up(file: Path = typer.Argument(..., help="cluster YAML"),
       timeout: float = typer.Option(30.0, metavar="SECONDS", help="seconds to wait for every agent to register")
       ) -> None:
    """Start the hub and one agent per node, and wait until all have registered.

    On a running cluster (same spec): restart what died, leave what lives; this also
    brings back a node `th failover` took out."""
    from .launch.cluster import AlreadyRunning, ReconcileError, Reconciled, SpecChanged, UpError, up as do_up
    from .launch.state import StateError

    try:
        s = specmod.load(file)
    except specmod.SpecError as exc:
        spec_problems(exc.lines)
    try:
        state = do_up(s, file, timeout=timeout, log=step)
    except AlreadyRunning as exc:
        out.print(f"{exc}; nothing changed", highlight=False, markup=False)
        return
    except SpecChanged as exc:
        fail(str(exc), 2)
    except StateError as exc:
        fail(str(exc), 1)
    except ReconcileError as exc:
        fail(f"{exc}\n(what was running was left running; what was restarted stays recorded: "
             f"`th up` again retries the rest, `th down -c {s.name}` stops it all)", 1)
    except UpError as exc:
        fail(f"{exc}\n(everything started was stopped again)", 1)
    if isinstance(state, Reconciled):
        out.print(f"cluster {s.name!r} reconciled: restarted {', '.join(state.restarted)}; "
                  f"left {', '.join(state.left) or 'nothing'} running", highlight=False, markup=False,
                  soft_wrap=True)
        return
    agents = sum(r.role == "agent" for r in state.procs)
    out.print(f"cluster {state.cluster!r} is up: {agents} agents registered with {state.hub_address}",
              highlight=False)


@app.command()
def down(cluster: Optional[str] = ClusterOpt,
         forget: bool = typer.Option(False, "--forget", help="drop the record even if some nodes cannot be reached "
                                     "(their processes, if any, keep running)")) -> None:
    """Stop every process `th up` started for the cluster (by recorded PID, if still ours).

    Idempotent, as `ray down` is: with nothing running it says so and exits 0."""
    from .launch.cluster import down as do_down
    from .launch.state import clear_state, pick_cluster, read_state, th_home

    try:
        name = pick_cluster(cluster)
    except LookupError as exc:
        if not any(th_home().glob("*/state.json")):
            out.print(f"no cluster is running under {th_home()}: nothing to stop", highlight=False, soft_wrap=True)
            return
        fail(exc.args[0], 2)  # several run: which one is the user's to say
    if read_state(name) is None:
        out.print(f"cluster {name!r} is not running: nothing to stop", highlight=False, soft_wrap=True)
        return
    try:
        results = do_down(name, log=step)
    except LookupError:  # stopped by someone else between our look and theirs
        out.print(f"cluster {name!r} is not running: nothing to stop", highlight=False, soft_wrap=True)
        return
    unknown = [f"{role}@{node}" for role, node, outcome in results if outcome.startswith("unknown")]
    if unknown and forget:
        clear_state(name)
        out.print(f"forgot {', '.join(unknown)}: not stopped")
    elif unknown:
        fail(f"could not stop {', '.join(unknown)} (unreachable, or the signal was refused: see above); "
             f"their state is kept: run `th down -c {name}` again "
             "(or add --forget if those nodes are gone for good)", 1)
    out.print(f"cluster {name!r} is down")


app.command()(status)
app.command()(versions)


def _hub_client(name: str, state):
    from .hub.client import HubClient
    from .launch.state import read_token

    return HubClient(state.hub_address, read_token(name))


@app.command()
def publish(model: str = typer.Argument(..., help="model name, e.g. policy"),
            source: Path = typer.Option(..., "--from", metavar="CKPT|HF_DIR",
                                        help="a .safetensors checkpoint, or an HF checkpoint directory "
                                        "(model.safetensors.index.json + shards, or model.safetensors): "
                                        "a path on that node"),
            version: Optional[int] = typer.Option(None, "--version", min=1, help="default: the newest known + 1"),
            node: Optional[str] = typer.Option(None, "--node", help="whose agent holds it (default: the hub's node)"),
            cluster: Optional[str] = ClusterOpt, timeout: float = typer.Option(
                300.0, min=1, metavar="SECONDS", help="seconds until the version must be READY")) -> None:
    """Load a checkpoint into a node's agent (host memory) and publish it as a version.

    A directory is read as Hugging Face writes one (`save_pretrained`): the shards its
    index names, by HF names. On a local cluster the checkpoint is checked here first."""
    from .launch import operate
    from .launch.models import publish_settings
    from .launch.state import cluster_dir
    from .names import check_model

    try:
        check_model(model, "MODEL")
    except ValueError as exc:
        fail(f"th publish: {exc}", 2)
    name, state = load_running(cluster)
    spec = specmod.load(cluster_dir(name) / "spec.yaml")
    node = node or spec.hub.node
    if node not in {n.name for n in spec.nodes()}:
        fail(f"th publish: --node {node!r} is not in cluster {name!r} "
             f"(nodes: {', '.join(n.name for n in spec.nodes())})", 2)
    chunk, undeclared = publish_settings(spec, model)
    if undeclared:
        err.print(f"th publish: {undeclared}", highlight=False, markup=False, soft_wrap=True)
    client = _hub_client(name, state)
    try:
        if spec.launcher == "local":  # the agent shares our file system: check before asking it
            _check_source(source)
        number = version or operate.next_version(client, model)
        v = operate.publish_file(client, node, model, str(source.resolve() if spec.launcher == "local" else source),
                                 number, chunk, timeout,
                                 log=lambda line: err.print(f"th publish: {line}", highlight=False, markup=False))
    except operate.OperateError as exc:
        fail(f"th publish: {exc}", exc.code)
    finally:
        client.close()
    out.print(f"published {model}@{v.version} from {source} on {node}: {v.nbytes / 2**20:.1f} MiB in {v.chunks} chunks")


def _check_source(source: Path) -> None:
    """`th publish --from`'s checkpoint, a file or an HF directory: ``OperateError`` (2) naming it."""
    from .adapters.hf import CheckpointError, check_dir
    from .launch.operate import OperateError, check_checkpoint

    if not source.exists():
        raise OperateError(f"--from {source}: no such file or directory", 2)
    if not source.is_dir():
        check_checkpoint(source)
        return
    try:
        check_dir(source)
    except CheckpointError as exc:
        raise OperateError(f"--from {exc}", 2) from None


@app.command()
def sync(model: str = typer.Argument(..., help="model name"),
         version: str = typer.Option("latest", "--version", help="N or latest"),
         role: Optional[str] = typer.Option(None, "--role", help="every endpoint of this role fetches "
                                            "(agent: every node's agent, into host memory)"),
         node: Optional[str] = typer.Option(None, "--node", help="every endpoint on this node fetches"),
         cluster: Optional[str] = ClusterOpt, timeout: float = typer.Option(
             600.0, min=1, metavar="SECONDS", help="seconds until every target must be complete"),
         as_json: bool = typer.Option(False, "--json", help="print the outcome as JSON, no progress bars")) -> None:
    """Have the target endpoints fetch a version; live progress per endpoint.

    Ctrl-C stops this command watching, not the fetches: the targets were asked already
    and finish on their own (it says who was where; `th status --watch` follows them)."""
    from .launch import operate
    from .ui.sync import SyncView, interrupted

    if (role is None) == (node is None):
        fail("th sync: give exactly one of --role ROLE or --node NODE", 2)
    if version != "latest" and not version.isdigit():
        fail(f"th sync: --version must be a number or 'latest', got {version!r}", 2)
    name, state = load_running(cluster)
    client = _hub_client(name, state)

    def log(line: str) -> None:
        err.print(f"th sync: {line}", highlight=False, markup=False)

    seen: list = []  # the last view of the run, for what to say on Ctrl-C

    def update(run) -> None:
        seen[:] = [run]
        if view is not None:
            view.update(run)

    view = None
    try:
        with contextlib.nullcontext() if as_json else SyncView(err) as view:
            run = operate.sync(client, model, None if version == "latest" else int(version), role, node, timeout,
                               update, log=log)
    except operate.OperateError as exc:
        fail(f"th sync: {exc}", exc.code)
    except KeyboardInterrupt:
        fail(interrupted(model, seen[0] if seen else None), 130)
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


@app.command()
def unpublish(model: str = typer.Argument(..., help="model name"),
              version: int = typer.Argument(..., min=1, help="the version to withdraw"),
              node: Optional[str] = typer.Option(None, "--node", help="only its holders on this node "
                                                 "(default: every holder; the version is gone)"),
              cluster: Optional[str] = ClusterOpt,
              timeout: float = typer.Option(60.0, min=0.1, max=86400.0, metavar="SECONDS",
                                            help="seconds for every copy to drain and go")) -> None:
    """Withdraw a version from every holder (or NODE's): reads in flight finish first."""
    from .launch.unpublish import UnpublishError, unpublish as do_unpublish
    from .names import check_model

    try:
        check_model(model, "MODEL")
    except ValueError as exc:
        fail(f"th unpublish: {exc}", 2)
    name, state = load_running(cluster)
    try:
        done = do_unpublish(name, state, model, version, node, timeout,
                            log=lambda line: err.print(f"th unpublish: {line}", highlight=False, markup=False))
    except UnpublishError as exc:
        fail(f"th unpublish: {exc}", exc.code)
    where = f" on {node}" if node else ""
    out.print(f"unpublished {model}@{version}{where} from {len(done.endpoints)} endpoint(s): "
              f"{', '.join(done.endpoints) or '-'}", highlight=False)


@app.command()
def logs(node: str = typer.Argument(..., help="node name, or 'hub'"), cluster: Optional[str] = ClusterOpt,
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines until Ctrl-C"),
         lines: int = typer.Option(50, "-n", "--lines", min=0, metavar="N",
                                   help="lines of each log to print first")) -> None:
    """Print (or follow) the logs of the processes on NODE (over ssh for ssh clusters)."""
    from .launch.logs import logs as node_logs
    from .launch.ssh import SshError

    name, state = load_running(cluster)
    try:
        node_logs(name, state, node, lines, follow, lambda text: print(text, end="", flush=True))
    except LookupError as exc:
        fail(exc.args[0], 2)
    except SshError as exc:
        fail(str(exc), 1)
    except KeyboardInterrupt:
        pass


def _operate(cluster: Optional[str], as_json: bool, action):
    """Run a ``scale``/``failover`` action; print what moved (or its JSON); returns the outcome."""
    from .launch.scale import BadInput, ScaleError, run

    name, state = load_running(cluster)
    try:
        outcome = run(name, state, action, log=(lambda *_: None) if as_json else (lambda line: step(line, err)))
    except ScaleError as exc:
        fail(str(exc), 2 if isinstance(exc, BadInput) else 1)
    if as_json:
        print(json.dumps(outcome.as_dict()))
    else:
        for what in ("stopped", "drained", "started"):
            names = getattr(outcome, what)
            out.print(f"{what}: {', '.join(names) if names else '-'}", highlight=False)
        for what, label in (("gone", "already gone"), ("lost", "lost")):
            if getattr(outcome, what, None):
                out.print(f"{label}: {', '.join(getattr(outcome, what))}", highlight=False)
    return outcome


@app.command()
def scale(change: str = typer.Argument(..., metavar="ROLE=COUNT|ROLE+N|ROLE-N",
                                       help="e.g. rollout=4, rollout+1, rollout-2"),
          cluster: Optional[str] = ClusterOpt, as_json: bool = JsonFlag) -> None:
    """Start or stop runners of a role on nodes with room; leavers unpublish with drain (and retention)."""
    _operate(cluster, as_json, lambda op: op.scale(change))


@app.command()
def failover(node: str = typer.Argument(..., help="the node to take out of service"),
             replace_with: Optional[str] = typer.Option(None, "--replace-with", metavar="NODE",
                                                        help="where its runners go (default: any node with room)"),
             cluster: Optional[str] = ClusterOpt, as_json: bool = JsonFlag) -> None:
    """Drain NODE's replicas (retention first), stop its runners and agent, start the runners elsewhere.

    An agent that was already dead cannot drain: the copies the hub said it held are
    reported lost. The node stays out of service (`th status` lists it so) until `th up
    SPEC` on the running cluster starts its agent again."""
    from .launch.state import cluster_dir

    _operate(cluster, as_json, lambda op: op.failover(node, replace_with))
    if not as_json:
        name, _ = load_running(cluster)
        step(f"{node} is out of service; to bring it back: `th up SPEC` (the spec the cluster runs; a copy is "
             f"{cluster_dir(name) / 'spec.yaml'})", err)


def main() -> None:
    from .launch.state import StateError
    from .ui.console import command_path

    try:
        app(prog_name="th")
    except StateError as exc:  # a corrupt state.json, whichever command read it: one line naming the file
        typer.echo(f"{command_path()}: {exc}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
