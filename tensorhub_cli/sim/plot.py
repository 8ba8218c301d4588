"""PNG of the scale curves (``th bench sim --plot``): matplotlib, headless (Agg).

Protocol: ``curves(result, path)`` draws, from ``result["curves"]``, time per version
(left) and the real hub's CPU per version (right) against rollout GPUs, ours and
star, on log-log axes; ``ui.plot.PlotUnavailable`` when matplotlib is missing.
"""

from __future__ import annotations

from pathlib import Path

from ..ui.plot import PlotUnavailable


def curves(result: dict, path: Path) -> None:
    if "curves" not in result:
        raise ValueError("the result has no curves: run the bench with curves (--plot) first")
    scale = result.get("scale", {}).get("rows", [])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'tensorhub-ros[plot]'") from None
    rows = result["curves"]["rows"]
    xs = [r["rollout_gpus"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for arm, style, label in (("ours", "o-", "ours (ROS)"), ("star", "s--", "star (all from the trainer)")):
        left.plot(xs, [r[f"{arm}_version_s"] for r in rows], style, label=label)
        right.plot(xs, [r[f"{arm}_hub_cpu_s"] for r in rows], style, label=label)
    if scale:  # --scale: ours against each run's network-only bound
        sx = [r["rollout_gpus"] for r in scale]
        left.plot(sx, [r["version_s"] for r in scale], "^-", label="ours, --scale")
        left.plot(sx, [r["bound_s"] for r in scale], ":", color="grey", label="network-only bound")
        right.plot(sx, [r["hub_cpu_s"] for r in scale], "^-", label="ours, --scale")
        if all("hub_cpu_alone_s" in r for r in scale):  # (files from before 2026-12-07 lack it)
            right.plot(sx, [r["hub_cpu_alone_s"] for r in scale], "v--",
                       label="ours, --scale, hub calls replayed alone")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"rollout GPUs (trainer: {result['curves']['trainer_gpus']} GPUs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    left.set_ylabel("simulated seconds per version")
    right.set_ylabel("hub CPU seconds per version (real hub)")
    gb = result.get("model_bytes", 0) / 1e9
    fig.suptitle(f"th bench sim: {gb:.0f} GB model, {result.get('chunk_bytes', 0) >> 20} MiB chunks, "
                 f"TP {result.get('rollout_tp', '?')}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
