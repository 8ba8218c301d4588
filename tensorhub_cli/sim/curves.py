"""Scale curves: time per version and the real hub's CPU per version against the number
of rollout GPUs, ours (ROS) and the trainer-star baseline.

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
