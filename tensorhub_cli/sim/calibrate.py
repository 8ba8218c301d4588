"""Calibration: the simulator at testbed size, against measurements stored in the
repository.

Protocol: ``measurements(folder)`` reads every ``*.json`` there shaped
``{"command", "date", "commit", "result"}`` (docs/measurements/README.md);
``rows(params, files)`` predicts each measured figure it knows how to model and
returns ``[{scenario, measured_s, predicted_s, error, source}]``, ``error`` being
|predicted - measured| / measured. Modelled now: ``th bench fanout --testbed`` rows on
the testbed the file names (its nodes, in 2 racks, one endpoint per node, the file's
node and rack rates, readers placed in ``bench.fanout``'s order, publisher and hub on
n1): ours (ROS planner) and star through the real hub, and the gloo broadcast arm as
the binomial tree it is (network only). Registration and memory setup are not
modelled: compare warm rows only (the bench warms up by default). ``th bench rl
--testbed`` (standalone, elastic) files: each load's fetch loop, on the bench's own
placement (``_rl_rows``). Files of other benches are listed in ``skipped`` with the
reason.

Link efficiencies (one direction, both directions at once, rack uplinks) come from
the testbed's own link check stored with each measurement (achieved ÷ expected per
link class), not from the rows predicted. The reader loop's costs (plan round trip,
checksum rate) are fitted once (``fit``: a grid minimising the largest error over
every stored row) and written to ``specs/sim.yaml`` by hand; a run reports the errors
of the YAML's values, not of a fresh fit.
"""

from __future__ import annotations

import itertools
import json
from statistics import fmean
from pathlib import Path

from . import scenario as sc
from .events import Loop
from .network import Network
from .params import SimParams
from .topology import Fabric, Topology
from .world import World

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "measurements"


def testbed_layout(nodes: int, racks: int) -> tuple[int, list[str]]:
    """(nodes per rack, reader nodes in the order ``bench.fanout`` uses them) of a
    testbed of ``nodes`` in ``racks``: racks filled in order as evenly as possible,
    earlier racks first (``scripts/testbed``), so ceil(nodes / racks) to a rack for
    the two racks the fan-out bench builds."""
    from ..bench.fanout import reader_order  # (the bench's own rule, so placement cannot drift)

    per = -(-nodes // racks)
    return per, reader_order(testbed_state(nodes, per))


def testbed_state(nodes: int, per_rack: int) -> dict:
    """The nodes of a one-DC testbed as ``scripts/testbed`` records them (names, racks,
    DC): what the benches' placement rules read."""
    return {"nodes": [{"name": f"n{i + 1}", "rack": f"rack{i // per_rack + 1}", "dc": "dc1"} for i in range(nodes)]}


def measurements(folder: Path | None = None) -> list[tuple[str, dict]]:
    folder = FOLDER if folder is None else Path(folder)
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a measurement file: {exc}") from None
        missing = [k for k in ("command", "date", "result") if k not in doc]
        if missing:
            raise ValueError(f"{path}: measurement file lacks {', '.join(missing)}")
        out.append((path.name, doc))
    return out


def efficiencies(params: SimParams, testbed: dict) -> dict[str, float]:
    """Link efficiencies: from the testbed's own link check in the file (achieved ÷
    expected per link class; ``scripts/testbed_kit/check.py``), else ``params.testbed``."""
    tb = params.testbed
    out = {"node": tb.link_efficiency, "duplex": tb.duplex_efficiency, "rack": tb.link_efficiency}
    for row in testbed.get("check") or []:
        if row.get("link") in out and row.get("expect_mbit"):
            out[row["link"]] = row["achieved_mbit"] / row["expect_mbit"]
    return out


def host_rate(res: dict) -> float | None:
    """Bytes per second the testbed's one host can move between its endpoint processes:
    its cores ÷ the CPU seconds ours spent per byte a reader received, over every ours
    row of the file (``ours_endpoint_cpu_s``, ``ours_cpu_floor_s``: the bench measures
    the CPU beside the time). None for files without those keys."""
    rows = [r for r in res.get("rows", ()) if r.get("ours_endpoint_cpu_s") and r.get("ours_cpu_floor_s")]
    if not rows:
        return None
    cores = rows[0]["ours_endpoint_cpu_s"] / rows[0]["ours_cpu_floor_s"]
    per_byte = sum(r["ours_endpoint_cpu_s"] for r in rows) / sum(res["bytes"] * r["readers"] for r in rows)
    return cores / per_byte


def _fabric(per_rack: int, node_mbit: float, rack_mbit: float | None, eff: dict[str, float],
            host_bytes_per_s: float | None = None) -> Fabric:
    return Fabric(gpus_per_node=1, nodes_per_rack=per_rack, nic_gbps=node_mbit / 1000, nvlink_gbps=node_mbit / 1000,
                  rack_uplink_gbps=rack_mbit / 1000 if rack_mbit else None, wan_gbps=None, efficiency=eff["node"],
                  duplex_efficiency=eff["duplex"], uplink_efficiency=eff["rack"], host_bytes_per_s=host_bytes_per_s)


def _testbed_world(params: SimParams, *, nodes: int, racks: int, window: int, planner: str, node_mbit: float,
                   rack_mbit: float | None, eff: dict[str, float], host_bytes_per_s: float | None,
                   protocol: str | None = None) -> World:
    per, _ = testbed_layout(nodes, racks)
    tb = params.testbed
    base = tb.schedule_fetch if protocol == "schedule" else tb.fetch
    fetch = base.model_copy(update={"window": window, **({"protocol": protocol} if protocol else {})})
    return World(params, [nodes], planner=planner, fetch=fetch,
                 fabric=_fabric(per, node_mbit, rack_mbit, eff, host_bytes_per_s), overhead_s=tb.request_overhead_s,
                 exact=True)


def loop_times(params: SimParams, *, rounds: list[list[str]], nbytes: int, chunk_bytes: int, window: int,
               planner: str, node_mbit: float, rack_mbit: float | None, eff: dict[str, float] | None = None,
               nodes: int = 8, racks: int = 2, host_bytes_per_s: float | None = None,
               protocol: str | None = None) -> list[list[float]]:
    """Per round, each reader's fetch (seconds from its start until it holds every
    chunk), readers named by testbed node ("n3"). The publisher (and the hub) on n1.
    A round's readers start together once the round before has ended, and keep what
    they fetched: later rounds may read from them (an RL joiner after the standing
    rollouts). With ``host_bytes_per_s`` every transfer also shares the one host's CPU
    (``host_rate``). The hub and the readers are ``params``' (``as_measured``: a
    file's)."""
    world = _testbed_world(params, nodes=nodes, racks=racks, window=window, planner=planner, node_mbit=node_mbit,
                           rack_mbit=rack_mbit, eff=eff or efficiencies(params, {}), host_bytes_per_s=host_bytes_per_s,
                           protocol=protocol)
    pub = world.endpoint("publisher", 0, "trainer")
    eps = [[world.endpoint(f"reader-{node}", int(node[1:]) - 1, "rollout") for node in names] for names in rounds]
    sc.register(world, [pub, *(ep for names in eps for ep in names)])
    t0 = sc.publish(world, [pub], "fan", 1, sc.manifests(nbytes, 1, chunk_bytes))
    out = []
    for names in eps:
        fetches = sc.fetch(world, [(ep, 0, t0) for ep in names], "fan", 1)
        out.append([fetches[ep.name].ended - fetches[ep.name].started for ep in names])
        t0 = world.loop.now
    world.close()
    return out


def fanout_time(params: SimParams, *, readers: int, nbytes: int, chunk_bytes: int, window: int, planner: str,
                node_mbit: float, rack_mbit: float | None, eff: dict[str, float] | None = None,
                nodes: int | None = None, racks: int = 2, host_bytes_per_s: float | None = None,
                protocol: str | None = None) -> float:
    """Seconds from the fetches' start until the last reader holds every chunk: the
    fan-out bench's readers (``bench.fanout``'s order) all starting at once."""
    nodes = nodes or readers + 1
    _, order = testbed_layout(nodes, racks)
    return max(loop_times(params, rounds=[order[:readers]], nbytes=nbytes, chunk_bytes=chunk_bytes, window=window,
                          planner=planner, node_mbit=node_mbit, rack_mbit=rack_mbit, eff=eff, nodes=nodes,
                          racks=racks, host_bytes_per_s=host_bytes_per_s, protocol=protocol)[0])


def broadcast_time(*, readers: int, nbytes: int, node_mbit: float, rack_mbit: float | None,
                   eff: dict[str, float], nodes: int | None = None, racks: int = 2) -> float:
    """gloo's broadcast of the payload from n1 to the readers' nodes (the fan-out
    bench's third arm): a binomial tree of whole-payload sends, no pipelining. Rank r
    (0: n1, k: the k-th reader node) receives the whole payload from its parent, then
    posts its sends to every child r + 2^i (2^i > r) at once, so they share its link:
    that is what the testbed measured (7 readers took 6.1 × S/B, 3 took 3.0 ×; one send
    after another would take 3 × and 2 ×). No hub is involved: only the network model."""
    nodes = nodes or readers + 1
    per, order = testbed_layout(nodes, racks)
    loop = Loop()
    net = Network(loop)
    topo = Topology(net, [nodes], _fabric(per, node_mbit, rack_mbit, eff))
    gpus = [topo.gpus[0]] + [topo.gpus[int(n[1:]) - 1] for n in order[:readers]]
    world = len(gpus)
    done = [0.0] + [None] * (world - 1)

    def holds(rank: int) -> None:  # rank has the payload: send it to all its children at once
        done[rank] = loop.now
        for child in _children(rank, world):
            net.start(topo.path(gpus[rank], gpus[child]), nbytes, lambda c=child: holds(c))

    holds(0)
    loop.run()
    return max(done)


def _children(rank: int, world: int) -> list[int]:
    """Rank's children in the binomial tree: rank + 2^i for every 2^i above rank."""
    step = 1
    while step <= rank:
        step <<= 1
    out = []
    while rank + step < world:
        out.append(rank + step)
        step <<= 1
    return out


def as_measured(params: SimParams, res: dict) -> SimParams:
    """``params`` with the hub and readers a fan-out file ran: chain heads read one
    chunk at a time only where it says ``"heads": "serial"`` (before, their whole
    window), relayed chunks are read in its ``"fragments"`` (before: whole), and the
    hub mustered for its ``"muster_s"`` (before musters: none, plans answered as they
    came)."""
    tb = params.testbed
    reader = {"serial_heads": res.get("heads") == "serial", "fragments": res.get("fragments", 1)}
    return params.model_copy(update={
        "hub": params.hub.model_copy(update={"muster_s": res.get("muster_s", 0.0)}),
        "testbed": tb.model_copy(update={"fetch": tb.fetch.model_copy(update=reader),
                                         "schedule_fetch": tb.schedule_fetch.model_copy(update=reader)}),
    })


def _fanout_rows(params: SimParams, name: str, doc: dict, host: float | None, skipped: list[str]) -> list[dict]:
    """``host``: the file's ``host_rate`` (gloo's CPU is not measured: the broadcast arm
    is predicted without it). Ours' rows of a file whose scheduled readers were chained
    in the order their plans arrived (before musters) are skipped: that order moved N
    = 7 by a fifth, and the file does not record it."""
    res = doc["result"]
    tb = res["testbed"]
    rates = tb["rates_mbit"]
    eff = efficiencies(params, tb)
    shape = {"nbytes": res["bytes"], "node_mbit": rates["node"], "rack_mbit": rates.get("rack"), "eff": eff,
             "nodes": tb.get("nodes"), "racks": tb.get("racks", 2)}
    out = []
    measured = as_measured(params, res)
    unordered = res.get("protocol") == "schedule" and "muster_s" not in res
    if unordered:
        skipped.append(f"{name}: ours' rows (chained in arrival order, not recorded: before musters)")
    for row in res["rows"]:
        for arm, key in (("ours", "ours_s"), ("star", "star_s"), ("broadcast", "broadcast_s")):
            if key not in row or arm == "ours" and unordered:
                continue
            if arm == "broadcast":
                pred = broadcast_time(readers=row["readers"], **shape)
            else:  # (files from before readers scheduled say nothing: the windowed loop)
                pred = fanout_time(measured, readers=row["readers"], chunk_bytes=res["chunk_bytes"],
                                   window=res["window"], planner="ros" if arm == "ours" else "star",
                                   host_bytes_per_s=host, protocol=res.get("protocol", "window"), **shape)
            meas = row[key]
            out.append({"scenario": f"fanout {arm} readers={row['readers']}", "measured_s": round(meas, 4),
                        "predicted_s": round(pred, 4), "error": round(abs(pred - meas) / meas, 4), "source": name})
    return out


def _rl_rows(params: SimParams, name: str, doc: dict, host: float | None) -> list[dict]:
    """``th bench rl --testbed`` (standalone, elastic): each load's fetch loop
    (``loop_by_version``, ``joiners_join_loop_s``: planning, transfers, checksums; not
    placing memory, not the probe check, not generation), predicted on the same
    placement (``bench.rl.testbed_layout``), payload, chunk size and window:
    - standalone, ours: version 1, which every rollout fetches at once with nothing
      else running (later versions are fetched while generating on the same cores);
    - standalone, baseline: every version (in-place rollouts, all fetching at once
      from the trainer: star);
    - elastic: a joiner's first fetch of a version the two standing rollouts already
      hold (ours: from them; baseline: from the trainer), each joiner alone, predicted
      on every joiner node (the file's list does not say which joiner each load was).
    Measured and predicted are means over the loads a row covers."""
    from ..bench.rl import TESTBED_NODES, TESTBED_RACKS, testbed_layout as rl_layout  # (the bench's own)

    res = doc["result"]
    k = res["knobs"]
    nodes, racks = TESTBED_NODES, TESTBED_RACKS
    per, _ = testbed_layout(nodes, racks)
    placed = rl_layout(res["workload"], k["rollouts"], testbed_state(nodes, per)).rollouts
    shape = {"nbytes": res["ours"]["version_bytes"], "chunk_bytes": int(k["chunk_mb"] * (1 << 20)),
             "window": k.get("window", 4), "node_mbit": res["rates_mbit"]["node"],
             "rack_mbit": res["rates_mbit"].get("rack"), "eff": efficiencies(params, {"check": res.get("check")}),
             "nodes": nodes, "racks": racks, "host_bytes_per_s": host}
    out = []

    def row(scenario: str, measured: list[float], predicted: float) -> None:
        meas = fmean(measured)
        out.append({"scenario": scenario, "measured_s": round(meas, 4), "predicted_s": round(predicted, 4),
                    "error": round(abs(predicted - meas) / meas, 4), "source": name})

    if res["workload"] == "standalone":
        n = len(placed)
        ours = loop_times(params, rounds=[placed], planner="ros", **shape)[0]
        row(f"rl standalone ours v1 rollouts={n} (mean fetch loop)", res["ours"]["loop_by_version"]["1"], fmean(ours))
        star = loop_times(params, rounds=[placed], planner="star", **shape)[0]
        every = [x for xs in res["baseline"]["loop_by_version"].values() for x in xs]
        row(f"rl standalone baseline every version rollouts={n} (mean fetch loop)", every, fmean(star))
    else:
        standing, joiners = placed[:2], placed[2:]
        for arm, planner in (("ours", "ros"), ("baseline", "star")):
            measured = res[arm].get("joiners_join_loop_s")
            if not measured:
                continue
            pred = [loop_times(params, rounds=[standing, [j]], planner=planner, **shape)[1][0] for j in joiners]
            row(f"rl elastic {arm} joiner of a replicated version (mean fetch loop)", measured, fmean(pred))
    return out


def rows(params: SimParams, files: list[tuple[str, dict]] | None = None) -> tuple[list[dict], list[str]]:
    """(rows, skipped): every modelled figure of the stored measurements."""
    files = measurements() if files is None else files
    out, skipped = [], []
    # The host's rate is the machine's, measured beside the fan-out rows: the RL rows
    # (same host, same engine, no CPU figure of their own) share it.
    hosts = {name: host_rate(doc["result"]) for name, doc in files if doc["result"].get("workload") == "fanout"}
    known = [h for h in hosts.values() if h]
    for name, doc in files:
        res = doc["result"]
        if res.get("workload") == "fanout" and "testbed" in res and not res.get("warmup"):
            skipped.append(f"{name}: fanout rows without a warm-up (first-fetch registration is not modelled)")
        elif res.get("workload") == "fanout" and "testbed" in res:
            out += _fanout_rows(params, name, doc, hosts[name], skipped)
        elif res.get("workload") in ("standalone", "elastic") and res.get("site") == "testbed" \
                and "loop_by_version" in res.get("ours", {}):
            out += _rl_rows(params, name, doc, fmean(known) if known else None)
        else:
            skipped.append(f"{name}: {res.get('workload', '?')} {'(testbed) ' if res.get('site') == 'testbed' else ''}"
                           "is not modelled yet")
    return out, skipped


def summary(params: SimParams, files: list[tuple[str, dict]] | None = None) -> dict:
    got, skipped = rows(params, files)
    return {"max_error": max((r["error"] for r in got), default=None), "rows": got, "skipped": skipped,
            "target": params.testbed.max_error,
            "met": bool(got) and max(r["error"] for r in got) <= params.testbed.max_error}


def fit(params: SimParams, files: list[tuple[str, dict]], rtts=(0.0005, 0.001, 0.002, 0.004, 0.008),
        verify_s=(0.0005, 0.001, 0.002, 0.004, 0.008), verify_gbps=(1.0, 2.0, 4.0, 8.0, 16.0),
        duplex=(None,), which: str = "fetch") -> tuple[dict, float]:
    """The grid point with the smallest largest error: (testbed settings, that error),
    with the hub's CPU not charged (so the fit is repeatable; at testbed size it is
    well under 1 % of a row). On the testbed ``verify_s`` stands for every fixed cost
    a reader pays per chunk (the engine's read setup, the loop, the report, the
    checksum's start), and ``plan_rtt_s`` includes queueing on the shaped links the
    requests share with the bulk data. ``duplex``: fallback duplex efficiencies to
    try, for files without a link check. ``which``: the testbed's ``fetch`` (files of
    windowed readers) or ``schedule_fetch`` (files of scheduled ones): fit each on its
    own files."""
    params = params.model_copy(update={"hub": params.hub.model_copy(update={"charge_cpu": False})})
    best: tuple[float, dict] = (float("inf"), {})
    for rtt, vs, vg, dx in itertools.product(rtts, verify_s, verify_gbps, duplex):
        tb = params.testbed.model_copy(update={
            "duplex_efficiency": dx, which: getattr(params.testbed, which).model_copy(update={
                "plan_rtt_s": rtt, "verify_s": vs, "verify_gbps": vg})})
        got, _ = rows(params.model_copy(update={"testbed": tb}), files)
        worst = max(r["error"] for r in got)
        if worst < best[0]:
            best = (worst, {"plan_rtt_s": rtt, "verify_s": vs, "verify_gbps": vg, "duplex_efficiency": dx})
    return best[1], best[0]


if __name__ == "__main__":  # python -m tensorhub_cli.sim.calibrate [--fit [--schedule]] [FILE.json ...]
    import sys

    from .params import load

    args = sys.argv[1:]
    fitting = "--fit" in args
    which = "schedule_fetch" if "--schedule" in args else "fetch"
    paths = [a for a in args if a not in ("--fit", "--schedule")]
    files = [(Path(a).name, json.loads(Path(a).read_text())) for a in paths] or None
    p = load()
    if fitting:
        print(json.dumps(fit(p, files or measurements(), which=which)))
    else:
        print(json.dumps(summary(p, files), indent=2))
