"""`th bench rl`: the RL loop's three workloads, ours against a baseline in one run.

Each arm starts a hub, one trainer and its rollouts (``runners/``) as processes on
loopback, reads the events they print (one JSON line each), asks the hub for its
counters, and stops every process by PID, also on failure. The same model, steps and
pacing run in both arms; only what the workload's baseline changes differs.

Ours runs double-buffered rollouts (``--double-buffer``: the next version is fetched
into a second copy while the current one generates and stays published; the swap is
the only pause) unless ``Knobs.double_buffer`` is off; every baseline runs in-place
rollouts, as veRL does.

- ``standalone``: every rollout fetches the newest version. Baseline: a veRL-style
  global sync stage: the star planner (every byte from the trainer), the trainer waits
  until every rollout holds the version, and each rollout waits for all the others.
- ``elastic``: two reliable rollouts run throughout; spot rollouts join one at a time,
  once the standing ones hold version 1 (then 2), and the first joiner leaves again. Baseline: the star
  planner, so joiners pull from the trainer only. ``joiners_join_from_trainer_bytes``
  is what joiners' first fetches of an already replicated version read from the
  trainer (its send counter for joiners; ``joins_replicated`` of ``joins`` qualified);
  ``joiners_from_trainer_bytes`` counts all their reads of it, new versions included.
  (In-place standing rollouts unpublish v the moment they fetch v+1: a joiner still
  reading v then reads the rest of it from the trainer. Double-buffered ones keep v
  published until v+2 needs its buffer.)
- ``cross-dc``: trainer and one rollout in dc1, three rollouts in dc2. Baseline: the
  star planner, so every remote rollout pulls across the DC link.

Loopback has no link rates: the stall figures are CPU- and memory-bound there, and
``bytes_by_level`` (from the hub's plan counters) is what shows the topology at work.
``--testbed`` runs the same on the namespace testbed (shaped links, each runner inside
its node): trainer on n1, rollouts spread over racks, or for cross-dc one rollout in
the trainer's DC and the rest in the other.

Reported per arm: ``rollout_stall_s`` (sum over rollouts of the time a new version kept
them from generating: double-buffered, the first fetch and then the swaps),
``fetch_s`` (sum of fetch + check, in the background when double-buffered),
``trainer_stall_s`` (sum over steps of time spent on weight movement), ``bytes_by_level``,
``versions_loaded`` and ``loaded_versions`` (per rollout, which), ``tokens`` generated
and ``tokens_per_gen_s`` (over the generation windows: what a background fetch costs
generation on a shared CPU shows there),
``loop_by_version`` and ``joiners_join_loop_s`` (each load's fetch loop, without memory
placing or the check: what ``sim.calibrate`` predicts), ``mean_staleness`` /
``max_staleness`` (per generation window, weighted by its rounds: the trainer's newest
version published when the window began minus the version it generated with),
``probe_mismatches``. Across arms: ``stall_ratio`` = baseline rollout stall ÷ ours,
and beside it ``versions_skipped``: versions the baseline's rollouts loaded that ours
(the rollout of the same name) passed over, between its first and last load; ours
trades those, and staleness, for stall.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..hub import protocol as p
from ..hub.client import HubClient
from ..launch.procs import stop_child
from .rig import RigError, hub
from .rl_deltas import WanMeter, arm_rows, summary
from .testbed import Site, link_counters, testbed

WORKLOADS = ("standalone", "elastic", "cross-dc")
# The testbed these workloads run on (cross-dc: 2 DCs of 2 racks each), which
# ``sim.calibrate`` rebuilds to predict the stored runs.
TESTBED_NODES, TESTBED_RACKS = 8, 2
LEVELS = ("node", "rack", "dc", "remote")


@dataclass
class Knobs:
    steps: int = 4
    rollouts: int = 3
    hidden: int = 512
    layers: int = 8
    step_s: float = 1.5  # the trainer's pace: a step at least this long
    join_step_s: float = 15.0  # elastic: the pace, so joiners (5-10 s to start) arrive between versions
    rollout_s: float = 0.3
    engine: str = "nixl"
    chunk_mb: float = 4.0
    window: int = 4  # each rollout's reads in flight
    double_buffer: bool = True  # ours: double-buffered rollouts (the baselines are in-place)
    timeout_s: float = 600.0
    dtype: str = "float32"  # the published weights' (bfloat16: float32 master weights, rounded)
    lr: float | None = None  # the trainer's (None: its default)
    # cross-dc: also run ours with deltas off and report the ``delta`` section
    # (bench/rl_deltas.py); ``wan_mbit``: the testbed's DC links' rate
    deltas: bool = False
    wan_mbit: float | None = None

    def model_args(self) -> list[str]:
        return ["--hidden", str(self.hidden), "--layers", str(self.layers), "--heads", "8", "--dtype", self.dtype]


def paced_step_s(k: Knobs) -> float:
    """The default pace: 1.5 s, or with a WAN rate 1.5 x the time one full version
    takes across it (plus a second), so each version crosses before the next is
    published and the WAN bytes of each can be told apart (``rl_deltas.WanMeter``)."""
    if not k.wan_mbit:
        return 1.5
    h, vocab = k.hidden, 2048  # runners.model: a Llama with 4h MLPs and as many KV heads as heads
    params = k.layers * (4 * h * h + 3 * h * 4 * h + 2 * h) + 2 * vocab * h + h
    nbytes = params * (2 if k.dtype == "bfloat16" else 4)
    return round(max(1.5, 1.5 * nbytes * 8 / (k.wan_mbit * 1e6) + 1.0), 2)


class Runner:
    """One runner process; its stdout events collected by a thread, stderr to a file.
    ``prefix`` runs it elsewhere (inside a testbed node: ``scripts/testbed exec``)."""

    def __init__(self, name: str, module: str, args: list[str], logdir: Path, prefix: list[str] | None = None):
        self.name = name
        self.log = logdir / f"{name}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", module, "--name", name, *args],
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        self.events: list[dict] = []
        self.remote = False  # runs in another DC than the trainer
        self._new: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a library printed to stdout: not an event
            self.events.append(event)
            self._new.put(event)
        self._new.put(None)

    def wait_for(self, event: str, timeout: float, **match) -> dict:
        """The first ``event`` (matching ``match``) seen so far or arriving within ``timeout``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for e in self.events[seen:]:
                if e["event"] == "mismatch":
                    raise RigError(f"{self.name}: probe or checksum mismatch: {e}")
                if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RigError(f"{self.name}: no {event} {match or ''} within {timeout:.0f}s; log ends:\n{self.tail()}")
            try:
                if self._new.get(timeout=min(left, 1.0)) is None and self.proc.poll() is not None:
                    if not any(e["event"] == event for e in self.events[seen:]):
                        raise RigError(f"{self.name} exited ({self.proc.returncode}) before {event}:\n{self.tail()}")
            except queue.Empty:
                pass

    def tail(self, chars: int = 2500) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def stop(self) -> None:
        stop_child(self.proc, timeout=30)


@dataclass
class Arm:
    name: str
    planner: str
    runners: list[Runner] = field(default_factory=list)


@dataclass
class Layout:
    """Where the trainer and rollouts run: loopback names with a made-up topology, or
    testbed nodes (their real addresses, racks and DCs, entered through ``site``)."""

    trainer: str
    rollouts: list[str]  # standing ones first, then joiners (elastic)
    site: Site = field(default_factory=Site)
    places: dict[str, tuple[str, str]] = field(default_factory=dict)  # loopback: node -> (dc, rack)

    def dc(self, node: str) -> str:
        if self.site.state:
            return next(x["dc"] for x in self.site.state["nodes"] if x["name"] == node)
        return self.places[node][0]

    def flags(self, node: str) -> list[str]:
        if self.site.state:
            return self.site.place(node)
        dc, rack = self.places[node]
        return ["--node", node, "--dc", dc, "--rack", rack]


def rollout_count(workload: str, n: int) -> int:
    """Rollout processes a workload runs: n; cross-dc one more in the trainer's DC;
    elastic two standing and two joiners."""
    return {"cross-dc": n + 1, "elastic": 4}.get(workload, n)


def loopback_layout(workload: str, n: int) -> Layout:
    if workload == "cross-dc":
        places = {"n1": ("dc1", "r1")} | {f"n{i + 2}": ("dc2", "r3") for i in range(n)}
    else:  # two racks of one DC; joiners (elastic) after the standing rollouts
        places = {f"n{i + 1}": ("dc1", "r1" if i % 2 else "r2") for i in range(rollout_count(workload, n))}
    return Layout("n0", list(places), places={"n0": ("dc1", "r1"), **places})


def testbed_layout(workload: str, n: int, state: dict) -> Layout:
    """Trainer on n1; rollouts alternate racks (standalone, elastic), or one in the
    trainer's DC and the rest in the other (cross-dc)."""
    nodes = {x["name"]: x for x in state["nodes"]}
    others = [x for x in nodes if x != "n1"]
    if workload == "cross-dc":
        home = [x for x in others if nodes[x]["dc"] == nodes["n1"]["dc"]][:1]
        away = [x for x in others if nodes[x]["dc"] != nodes["n1"]["dc"]][:n]
        chosen = home + away
    else:
        by_rack: dict[str, list[str]] = {}
        for x in others:
            by_rack.setdefault(nodes[x]["rack"], []).append(x)
        chosen = [x for group in zip(*by_rack.values()) for x in group]
    need = rollout_count(workload, n)
    if len(chosen) < need:
        raise ValueError(f"--rollouts {n}: this workload needs {need} rollout nodes, the testbed has {len(chosen)}")
    return Layout("n1", chosen[:need], site=Site(state))


def run_arm(workload: str, baseline: bool, k: Knobs, logdir: Path, layout: Layout, deltas: str = "remote",
            wan: Callable[[], int] | None = None) -> dict:
    """One arm; ``deltas``: the hub's delta mode; ``wan``: the WAN byte counter to
    sample per version (``rl_deltas.WanMeter``)."""
    planner = "star" if baseline else "ros"
    token = os.urandom(16).hex()
    token_file = logdir / "token"
    token_file.write_text(token)
    site = layout.site
    meter = WanMeter(wan, lambda: trainer.of("published") if trainer is not None else [])
    trainer = None
    with hub(planner=planner, expiry_s=5.0, token=token, host=site.address(layout.trainer),
             prefix=site.prefix(layout.trainer), deltas=deltas) as (address, _), meter:
        common = ["--hub", address, "--token-file", str(token_file), "--engine", k.engine, *k.model_args()]
        roll = [*common, "--rollout-s", str(k.rollout_s), "--until-version", str(k.steps), "--window", str(k.window),
                "--duration-s", str(k.timeout_s), *(["--double-buffer"] if k.double_buffer and not baseline else [])]
        runners: list[Runner] = []

        def start(name, module, node, *args) -> Runner:
            r = Runner(name, module, [*args, *layout.flags(node)], logdir, prefix=site.prefix(node))
            r.remote = layout.dc(node) != layout.dc(layout.trainer)
            runners.append(r)
            return r

        try:
            trainer = None
            n = k.rollouts
            sync = ["--barrier", str(n)] if baseline and workload == "standalone" else []
            standing = layout.rollouts[:2] if workload == "elastic" else layout.rollouts
            for i, node in enumerate(standing):
                start(f"rollout-{i}", "runners.rollout", node, *roll, *sync)
            for r in runners:  # built, joined and waiting before the first step
                r.wait_for("started", 120)
            # Elastic: steps long enough that a joiner (seconds to import and build its
            # model) arrives while the version it fetches is already replicated.
            step_s = max(k.step_s, k.join_step_s) if workload == "elastic" else k.step_s
            trainer = start("trainer", "runners.trainer", layout.trainer, *common,
                            "--steps", str(k.steps), "--step-s", str(step_s), "--chunk-mb", str(k.chunk_mb),
                            "--linger-s", str(k.timeout_s), *(["--lr", str(k.lr)] if k.lr is not None else []),
                            *(["--wait-for-readers", str(n)] if sync else []))
            if workload == "elastic":
                # Joiners: one after version 1, one after version 2; the first leaves
                # again once it loaded a version after joining (spot capacity goes away).
                for j, after in enumerate((1, 2)):
                    for r in runners[:2]:  # the standing rollouts hold it: replicas exist
                        r.wait_for("loaded", k.timeout_s, version=after)
                    joiner = start(f"rollout-spot-{j}", "runners.rollout", layout.rollouts[2 + j], *roll, "--spot")
                    if j == 0:
                        joiner.wait_for("loaded", k.timeout_s)
                        joiner.stop()
            for r in runners:
                if r is not trainer and r.proc.poll() is None:
                    r.wait_for("done", k.timeout_s)
            counters = _counters(address, token)
            trainer.stop()
        finally:
            for r in reversed(runners):
                r.stop()
    rollouts = [r for r in runners if r is not trainer]
    loaded = [e for r in rollouts for e in r.of("loaded")]
    version_bytes = max((e["bytes"] for e in loaded), default=0)
    mean_stale, max_stale = _staleness(rollouts, trainer)
    return {
        "planner": planner,
        "rollouts": "double-buffered" if k.double_buffer and not baseline else "in-place",
        "rollout_stall_s": round(sum(e["stall_s"] for e in loaded), 4),
        "fetch_s": round(sum(e.get("fetch_s", e["stall_s"]) for e in loaded), 4),
        "trainer_stall_s": round(sum(e["stall_s"] for e in trainer.of("published")), 4),
        "bytes_by_level": {lv: int(counters.get(f"bytes_planned.level.{lv}", 0)) for lv in LEVELS},
        "version_bytes": version_bytes,
        # Copies of a version that crossed a DC link, summed over versions (ours: one
        # per version that reached the other DC; baseline: one per remote load).
        "remote_copies": round(counters.get("bytes_planned.level.remote", 0) / version_bytes, 3)
        if version_bytes else 0.0,
        "remote_versions": len({e["version"] for r in rollouts for e in r.of("loaded") if r.remote}),
        # Every byte spot readers were planned from the trainer, over the whole run (new
        # versions included), and what their first fetch after joining read from it.
        "joiners_from_trainer_bytes": int(counters.get("bytes_planned.from_publishers.spot", 0)),
        **_joins(rollouts),
        "stall_by_version": {str(v): round(sum(e["stall_s"] for e in loaded if e["version"] == v), 4)
                             for v in sorted({e["version"] for e in loaded})},
        # Each load's fetch loop (planning, transfers, checksums), per version: the
        # figures the simulator predicts (sim.calibrate); rollouts in name order.
        "loop_by_version": {str(v): [round(e.get("loop_s", 0.0), 4) for e in loaded if e["version"] == v]
                            for v in sorted({e["version"] for e in loaded})},
        "versions_loaded": len(loaded),
        "loaded_versions": {r.name: [e["version"] for e in r.of("loaded")] for r in rollouts},
        "tokens": sum(e["tokens"] for r in rollouts for e in r.of("generated")),
        "tokens_per_gen_s": _rate(rollouts),
        "mean_staleness": mean_stale,
        "max_staleness": max_stale,
        "probe_mismatches": sum(len(r.of("mismatch")) for r in rollouts),
        "retries": sum(len(r.of("retry")) for r in rollouts),
        "deltas": "off" if baseline else deltas,
        # per version: WAN bytes (testbed), the remote rollouts' wait, their delta reads
        "by_version": arm_rows(meter, trainer.of("published"), [e for r in rollouts if r.remote for e in r.of("loaded")]),
    }


def _staleness(rollouts: list[Runner], trainer: Runner) -> tuple[float | None, int]:
    """(mean, max) over generation windows, the mean weighted by each window's rounds:
    the newest version the trainer had published when the window began, minus the
    version the window generated with."""
    published = [(e["published_at"], e["version"]) for e in trainer.of("published")]
    total = rounds = worst = 0
    for e in (e for r in rollouts for e in r.of("generated") if e["rounds"]):
        newest = max((v for t, v in published if t <= e["began"]), default=0)
        stale = max(0, newest - e["version"])
        total += stale * e["rounds"]
        rounds += e["rounds"]
        worst = max(worst, stale)
    return (round(total / rounds, 3) if rounds else None), worst


def _rate(rollouts: list[Runner]) -> float | None:
    """Tokens per second of generation window, over every rollout's windows."""
    windows = [e for r in rollouts for e in r.of("generated")]
    seconds = sum(e["t"] - e["began"] for e in windows)
    return round(sum(e["tokens"] for e in windows) / seconds, 2) if seconds > 0 else None


def _skipped(ours: dict, base: dict) -> int:
    """Versions a baseline rollout loaded that ours of the same name passed over: newer
    than its first load, older than its last. (A joiner that came in, or left, at
    another version than its baseline twin skipped nothing it was there for.)"""
    count = 0
    for name, vs in base["loaded_versions"].items():
        mine = ours["loaded_versions"].get(name, [])
        count += sum(1 for v in set(vs) - set(mine) if mine and mine[0] < v < mine[-1])
    return count


def _joins(rollouts: list[Runner]) -> dict:
    """Joiners' first fetches, split by whether a standing rollout already held that
    version when the fetch began ("once replicas exist"): only those must read 0 bytes
    from the trainer. A joiner slow to start may instead meet a version just published,
    and fetch it alongside everyone else."""
    standing = [e for r in rollouts if not r.name.startswith("rollout-spot") for e in r.of("loaded")]
    firsts = [r.of("loaded")[0] for r in rollouts if r.name.startswith("rollout-spot") and r.of("loaded")]
    replicated = [e for e in firsts if any(s["version"] == e["version"] and s["t"] <= e["began"] for s in standing)]
    return {"joins": len(firsts), "joins_replicated": len(replicated),
            "joiners_join_from_trainer_bytes": sum(e["from_publishers"] for e in replicated),
            "joiners_join_loop_s": [round(e.get("loop_s", 0.0), 4) for e in replicated]}


def _counters(address: str, token: str) -> dict[str, float]:
    client = HubClient(address, token)
    try:
        reply = client.call(p.Status(), timeout=10.0)
    finally:
        client.close()
    return reply.counters


def run(workload: str, knobs: Knobs | None = None, on_testbed: bool = False) -> dict:
    """Ours, then the baseline, on loopback or on an 8-node testbed built for the run
    (2 racks; 2 DCs of 2 racks for cross-dc) and removed after it, even on failure."""
    if workload not in WORKLOADS:
        raise ValueError(f"--workload {workload!r}: not one of {', '.join(WORKLOADS)}")
    k = knobs or Knobs()
    if k.deltas and workload != "cross-dc":
        raise ValueError(f"--deltas: delta rows are of the cross-dc workload, not {workload}")
    if k.wan_mbit is not None and not (on_testbed and workload == "cross-dc" and k.wan_mbit > 0):
        raise ValueError("--wan-mbit: a WAN rate is the testbed's DC links' (needs --testbed, "
                         f"--workload cross-dc and a rate > 0; got {k.wan_mbit})")
    where: dict = {"site": "loopback"}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="th-bench-rl-"))
        wan = None
        if on_testbed:
            flags = ["--dcs", "2", "--racks", str(2 * TESTBED_RACKS)] if workload == "cross-dc" \
                else ["--racks", str(TESTBED_RACKS)]
            if k.wan_mbit:
                flags += ["--dc-gbps", str(k.wan_mbit / 1000)]
            state = stack.enter_context(testbed(TESTBED_NODES, *flags))
            layout = testbed_layout(workload, k.rollouts, state)
            where = {"site": "testbed", "rates_mbit": state["rates_mbit"], "check": state["check"]}
            if workload == "cross-dc":
                far = layout.dc(layout.rollouts[-1])

                def wan() -> int:  # what went down into the rollouts' DC: every copy that crossed
                    return link_counters(state, "dc", far)["tx_bytes"]
        else:
            layout = loopback_layout(workload, k.rollouts)
        plan = [("ours", False, "remote"), ("baseline", True, "off")]
        if k.deltas:
            plan.insert(1, ("ours_full", False, "off"))
        arms = {}
        for arm, baseline, mode in plan:
            logdir = Path(tmp) / arm
            logdir.mkdir()
            arms[arm] = run_arm(workload, baseline, k, logdir, layout, deltas=mode if k.deltas else "remote", wan=wan)
    ours, base = arms["ours"], arms["baseline"]
    extra = {}
    if k.deltas:
        extra = {"ours_full": arms["ours_full"],
                 "delta": summary(ours["by_version"], arms["ours_full"]["by_version"], ours["version_bytes"])}
    return {
        "workload": workload, **where, "ours": ours, "baseline": base,
        "stall_ratio": round(base["rollout_stall_s"] / ours["rollout_stall_s"], 3) if ours["rollout_stall_s"] else None,
        # (beside the stall ratio: what ours gave for it)
        "versions_skipped": _skipped(ours, base),
        "mean_staleness": {"ours": ours["mean_staleness"], "baseline": base["mean_staleness"]},
        "trainer_stall_ratio": round(base["trainer_stall_s"] / ours["trainer_stall_s"], 3)
        if ours["trainer_stall_s"] else None,
        "probe_mismatches": sum(a["probe_mismatches"] for a in arms.values()),
        **extra,
        "knobs": k.__dict__,
    }
