"""`th bench sim`: the flow-level simulator's three workloads at cluster scale, its
calibration against stored testbed measurements, and (with ``--plot``) scale curves.

Protocol: ``run(gpus, params_file, curves)`` loads the parameters (``specs/sim.yaml``
documents the defaults; a file given replaces any of them), runs standalone, elastic
and cross-DC, each ours (ROS planner) then its baseline (star planner; standalone's
with the global stage's barrier), on ``gpus`` GPUs split trainer:rollout by
``roles.trainer_fraction``; then the calibration rows (``sim.calibrate``) and, when
asked, the curves (``sim.curves``). It returns one JSON-able dict whose required keys
are ``gpus``, ``workloads.standalone.{ours_stall_s, baseline_stall_s, stall_ratio}``,
``workloads.elastic.{ours_update_s, baseline_update_s, update_ratio}``,
``workloads.cross_dc.{ours_stall_s, baseline_stall_s, stall_ratio}``, each workload
also ``baseline_gathered`` and ``ratio_gathered`` (the baseline with ``roles.export``
"gathered": one sender per trainer node),
``workloads.cross_dc.deltas.{ratio, wan_bytes_ratio, remote_stall_ratio,
stall_ratio_with_deltas}``,
``calibration.{max_error, rows}`` and ``wall_s``; ``cpu_s`` is this process's CPU time
(the whole run is one thread: on a shared machine, the one-core figure), and ``wall``
says where the wall time went (per part, and how much of it the real hub's own CPU was). Simulated seconds are
not wall seconds: nothing here sleeps. ``profile``: a cProfile of the whole run is
written there.

Deltas (``run(deltas=True)``, ``th bench sim --deltas``; ``params.deltas``; docs/design.md,
"Deltas"): cross-DC also runs its two-version
variant (``workloads.cross_dc_versions``, the v2 round measured) four times with one
seed: ours and the baseline, each with deltas off and on (whatever ``deltas.enabled``
says). ``wan_bytes_ratio`` and ``remote_stall_ratio`` are ours with deltas ÷ ours
without; ``stall_ratio_with_deltas`` is the baseline's remote stall ÷ ours, both with
deltas (the baseline's remote rollouts each pull a delta from the trainer, as slime and
miles send theirs); ``stall_ratio_full_baseline`` the same against a baseline that pulls
full chunks, ``stall_ratio_without_deltas`` both without. These four runs are the
dearest part of the wall (at 1,024 GPUs ours with deltas alone was 60 %: its far readers
poll while the seeds rebuild for simulated minutes).
"""

from __future__ import annotations

import cProfile
import time
from pathlib import Path

from ..sim import calibrate
from ..sim import curves as sim_curves
from ..sim import workloads as W
from ..sim.params import SimParams, load


def _r(x: float, n: int = 4) -> float:
    return round(x, n)


def _detail(arm: dict, keys: tuple[str, ...]) -> dict:
    return {k: _r(arm[k]) if isinstance(arm[k], float) else arm[k] for k in keys if k in arm}


_COMMON = ("version_s", "start_burst_s", "hub_cpu_s", "hub_busy_s", "hub_max_queue", "expired_alive",
           "silence_max_s", "bytes_by_level", "from_trainer_bytes")


def _arms(name: str, wall: dict, ours_run, base_run) -> tuple[dict, dict]:
    """Ours, then the baseline, of one workload (each a no-argument call), each timed into ``wall``."""
    w0 = time.perf_counter()
    ours = ours_run()
    w1 = time.perf_counter()
    base = base_run()
    wall[f"{name}.ours"] = (w1 - w0, ours)
    wall[f"{name}.baseline"] = (time.perf_counter() - w1, base)
    return ours, base


def _gathered(p: SimParams) -> SimParams:
    """The baseline's other export (docs/design.md, "The baselines"): one rank per
    trainer node sends, as an engine that gathers its weights before sending does."""
    return p.model_copy(update={"roles": p.roles.model_copy(update={"export": "gathered"})})


def _gathered_arm(name: str, wall: dict, run, key: str, ours: float) -> dict:
    """The baseline again with a gathered export: its ``key`` figure and its ratio to ours'."""
    w0 = time.perf_counter()
    base = run()
    wall[f"{name}.baseline_gathered"] = (time.perf_counter() - w0, base)
    return {"baseline_gathered": _r(base[key]), "ratio_gathered": _r(base[key] / ours, 3)}


def _standalone(p: SimParams, t: int, r: int, wall: dict) -> dict:
    ours, base = _arms("standalone", wall, lambda: W.standalone(p, "ros", t, r, barrier=False),
                       lambda: W.standalone(p, "star", t, r, barrier=True))
    keys = (*_COMMON, "tp", "rollout_stall_s", "trainer_stall_s", "publish_s")
    return {"ours_stall_s": _r(ours["stall_s"]), "baseline_stall_s": _r(base["stall_s"]),
            "stall_ratio": _r(base["stall_s"] / ours["stall_s"], 3),
            **_gathered_arm("standalone", wall, lambda: W.standalone(_gathered(p), "star", t, r, barrier=True),
                            "stall_s", ours["stall_s"]),
            "ours": _detail(ours, keys), "baseline": _detail(base, keys)}


def _elastic(p: SimParams, t: int, r: int, wall: dict) -> dict:
    ours, base = _arms("elastic", wall, lambda: W.elastic(p, "ros", t, r), lambda: W.elastic(p, "star", t, r))
    keys = (*_COMMON, "tp", "standing_gpus", "joiner_gpus")
    return {"ours_update_s": _r(ours["update_s"]), "baseline_update_s": _r(base["update_s"]),
            "update_ratio": _r(base["update_s"] / ours["update_s"], 3),
            **_gathered_arm("elastic", wall, lambda: W.elastic(_gathered(p), "star", t, r), "update_s",
                            ours["update_s"]),
            "ours": _detail(ours, keys), "baseline": _detail(base, keys)}


def _cross_dc(p: SimParams, t: int, r: int, wall: dict, deltas: bool = False) -> dict:
    ours, base = _arms("cross_dc", wall, lambda: W.cross_dc(p, "ros", t, r), lambda: W.cross_dc(p, "star", t, r))
    keys = (*_COMMON, "tp", "remote_version_s", "remote_stall_s", "local_stall_s", "local_gpus", "remote_gpus", "wan_copies")
    return {"ours_stall_s": _r(ours["remote_stall_s"]), "baseline_stall_s": _r(base["remote_stall_s"]),
            "stall_ratio": _r(base["remote_stall_s"] / ours["remote_stall_s"], 3),
            **_gathered_arm("cross_dc", wall, lambda: W.cross_dc(_gathered(p), "star", t, r), "remote_stall_s",
                            ours["remote_stall_s"]),
            "ours": _detail(ours, keys), "baseline": _detail(base, keys),
            # (four two-version runs, most of the bench's wall: only when asked, ``--deltas``)
            "deltas": _cross_dc_deltas(p, t, r, wall) if deltas else None}


def _with_deltas(p: SimParams, on: bool) -> SimParams:
    return p.model_copy(update={"deltas": p.deltas.model_copy(update={"enabled": on})})


def _cross_dc_deltas(p: SimParams, t: int, r: int, wall: dict) -> dict:
    runs = {}
    for arm, planner in (("ours", "ros"), ("baseline", "star")):
        for on in (False, True):
            name = f"{arm}_deltas" if on else arm
            w0 = time.perf_counter()
            runs[name] = W.cross_dc_versions(_with_deltas(p, on), planner, t, r)
            wall[f"cross_dc.deltas.{name}"] = (time.perf_counter() - w0, runs[name])
    ours, ours_d, base, base_d = runs["ours"], runs["ours_deltas"], runs["baseline"], runs["baseline_deltas"]
    d, chunk = p.deltas, p.model.chunk_bytes
    keys = ("version_s", "remote_version_s", "remote_stall_s", "local_stall_s", "wan_bytes", "wan_copies",
            "wan_readers", "delta_chunks", "bytes_by_level")
    return {"ratio": d.ratio, "rebuild_gbps": d.rebuild_gbps, "levels": list(d.levels),
            "wan_bytes_ratio": _r(ours_d["wan_bytes"] / ours["wan_bytes"]),
            "remote_stall_ratio": _r(ours_d["remote_stall_s"] / ours["remote_stall_s"]),
            "stall_ratio_with_deltas": _r(base_d["remote_stall_s"] / ours_d["remote_stall_s"], 3),
            "stall_ratio_full_baseline": _r(base["remote_stall_s"] / ours_d["remote_stall_s"], 3),
            "stall_ratio_without_deltas": _r(base["remote_stall_s"] / ours["remote_stall_s"], 3),
            # why a delta may cost more than it saves: one chunk's rebuild on one verifier
            # against the same chunk alone on the WAN link
            "rebuild_s_per_chunk": _r(chunk * 8 / (d.rebuild_gbps * 1e9)),
            "wan_s_per_chunk": _r(chunk * 8 / (p.cluster.wan_gbps * 1e9 * p.cluster.link_efficiency)),
            **{name: _detail(arm, keys) for name, arm in runs.items()}}


def run(gpus: int | None = None, params_file: Path | str | None = None, curves: bool = False, deltas: bool = False,
        measurements: Path | str | None = None, profile: Path | str | None = None, scale: bool = False,
        chunk_mib: float | None = None) -> dict:
    began, cpu0 = time.perf_counter(), time.process_time()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    try:
        p = load(params_file)
        if chunk_mib is not None:  # (the cluster-scale runs; calibration keeps the testbed's chunks)
            if not chunk_mib > 0:
                raise ValueError(f"chunk_mib must be > 0, not {chunk_mib}")
            p = p.model_copy(update={"model": p.model.model_copy(update={"chunk_mib": float(chunk_mib)})})
        gpus = gpus or p.cluster.gpus
        t, r = W.split(p, gpus)
        wall: dict[str, tuple[float, dict]] = {}
        workloads = {"standalone": _standalone(p, t, r, wall), "elastic": _elastic(p, t, r, wall),
                     "cross_dc": _cross_dc(p, t, r, wall, deltas)}
        w0 = time.perf_counter()
        files = calibrate.measurements(measurements) if measurements is not None else None
        calibration = calibrate.summary(p, files)
        parts = {name: {"wall_s": _r(w, 2), "hub_cpu_s": _r(arm["hub_cpu_total_s"], 2),
                        "events": arm.get("events", 0)} for name, (w, arm) in wall.items()}
        parts["calibration"] = {"wall_s": _r(time.perf_counter() - w0, 2)}
        out = {
            "gpus": gpus, "trainer_gpus": t, "rollout_gpus": r, "rollout_tp": p.roles.rollout_tp,
            "model_bytes": p.model.nbytes, "chunk_bytes": p.model.chunk_bytes, "window": p.fetch.window,
            "hub_cpu_charged": p.hub.charge_cpu,
            "hub_own_process": p.hub.charge_cpu and p.hub.own_process,  # where that CPU was measured
            "workloads": workloads,
            "calibration": calibration,
        }
        if curves:
            w0 = time.perf_counter()
            out["curves"] = sim_curves.run(p)
            parts["curves"] = {"wall_s": _r(time.perf_counter() - w0, 2)}
        if scale:
            w0 = time.perf_counter()
            out["scale"] = sim_curves.scale(p)
            parts["scale"] = {"wall_s": _r(time.perf_counter() - w0, 2)}
        out["wall"] = parts
        out["wall_s"] = _r(time.perf_counter() - began, 2)
        out["cpu_s"] = _r(time.process_time() - cpu0, 2)  # this process's CPU: the one-core figure
        return out
    finally:
        if prof:
            prof.disable()
            prof.dump_stats(str(profile))


def plot(result: dict, path: Path | str) -> None:
    from ..sim.plot import curves as draw

    draw(result, Path(path))
