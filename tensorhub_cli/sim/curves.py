"""Scale curves: time per version and the real hub's CPU per version against the number
of rollout GPUs, ours (ROS) and the trainer-star baseline; and (``scale``) ours alone
against the network-only bound of each run, up to thousands of rollout GPUs.

Protocol: ``run(params)`` runs the standalone workload (no barrier: the time until the
last rollout GPU holds its slice) for each count in ``curves.rollout_gpus``, with the
trainer held at ``curves.trainer_gpus`` GPUs and the model, chunking and TP of the
params, so only the number of readers changes along the curve. Per point: simulated
seconds per version, hub CPU seconds per version (process time inside the real
``Hub``, from publish to the last reader), the hub core's busy share and the wall
seconds the point took.
"""

from __future__ import annotations

import time

from . import alone as A
from . import workloads as W
from .params import SimParams


def run(params: SimParams) -> dict:
    c = params.curves
    rows = []
    for n in c.rollout_gpus:
        row = {"rollout_gpus": n, "trainer_gpus": c.trainer_gpus}
        for arm, planner in (("ours", "ros"), ("star", "star")):
            w0 = time.perf_counter()
            got = W.standalone(params, planner, c.trainer_gpus, n, barrier=False)
            row[f"{arm}_version_s"] = round(got["version_s"], 4)
            row[f"{arm}_hub_cpu_s"] = round(got["hub_cpu_s"], 4)
            row[f"{arm}_hub_busy"] = round(got["hub_busy_s"] / got["version_s"], 3) if got["version_s"] else 0.0
            row[f"{arm}_wall_s"] = round(time.perf_counter() - w0, 2)
        rows.append(row)
    return {"x": "rollout_gpus", "trainer_gpus": c.trainer_gpus, "rows": rows}


SCALE_GPUS = (32, 64, 128, 256, 512, 1024, 2048, 4096)


def bound_s(params: SimParams, trainer: int, run: dict) -> float:
    """The network-only bound of a standalone run: the busiest NIC's bytes at the NIC's
    rate: a reader's own slice in, or a trainer's shard out once (no schedule does
    better; relays add neither, as each reader sends at most what it receives)."""
    c = params.cluster
    rate = c.nic_gbps * 1e9 / 8 * c.link_efficiency
    return max(run["max_reader_bytes"], params.model.nbytes / trainer) / rate


def scale(params: SimParams, gpus=SCALE_GPUS) -> dict:
    """``th bench sim --scale``: ours, standalone, at each count of rollout GPUs, the
    trainer held at ``curves.trainer_gpus``. Per row: ``version_s``, ``bound_s``,
    ``hub_cpu_s`` (the real hub's CPU for the version), ``hub_busy`` (its busy share
    of the version's time) and ``start_burst_s`` (when the last reader had its first
    plan answered: ``version_s`` is at least that plus the reader's own bytes at its
    NIC's rate, so what the hub takes to answer every reader once is time the bound
    does not count); ``hub_cpu_alone_s``, the same hub calls replayed in a process
    holding only the hub (``sim.alone``), and ``hub_busy_alone``, the busy share that
    CPU and the requests' modelled cost make of the same ``version_s`` (the run itself
    was charged ``hub_cpu_s``, measured in the hub's own process where
    ``hub.own_process``: ``sim.hubhost``, "Warm and cold")."""
    t = params.curves.trainer_gpus
    # The schedule protocol: the design these rows judge (``fetch.protocol`` says what
    # the workloads and curves run).
    params = params.model_copy(update={"fetch": params.fetch.model_copy(update={"protocol": "schedule"})})
    rows = []
    for n in gpus:
        w0 = time.perf_counter()
        got = W.standalone(params, "ros", t, n, barrier=False, record=True)
        v = got["version_s"]
        b = bound_s(params, t, got)
        alone = A.cpu_s(got["hub_log"])
        h, calls = params.hub, got["hub_calls"]
        requests = sum(calls.values()) - calls.get("sweep", 0) - calls.get("muster", 0)  # (the hub's own timers)
        busy_alone = alone * h.cpu_scale + requests * h.request_overhead_s if h.charge_cpu else 0.0
        rows.append({"rollout_gpus": n, "trainer_gpus": t, "tp": got["tp"], "version_s": round(v, 4),
                     "bound_s": round(b, 4), "over_bound": round(v / b, 3) if b else None,
                     "start_burst_s": round(got["start_burst_s"], 4),
                     "hub_cpu_s": round(got["hub_cpu_s"], 4), "hub_busy": round(got["hub_busy_s"] / v, 3) if v else 0.0,
                     "hub_cpu_alone_s": round(alone, 4), "hub_busy_alone": round(busy_alone / v, 3) if v else 0.0,
                     "hub_calls": sum(got["hub_calls"].values()), "wall_s": round(time.perf_counter() - w0, 2)})
    first, last = rows[0], rows[-1]
    return {"x": "rollout_gpus", "trainer_gpus": t, "protocol": "schedule", "rows": rows,
            # hub CPU per version per rollout GPU, last row over first: 1.0 is linear
            "hub_cpu_growth": round(last["hub_cpu_s"] / last["rollout_gpus"] / (first["hub_cpu_s"] / first["rollout_gpus"]), 3)
            if first["hub_cpu_s"] else None}
