"""PNG charts for `th bench … --plot` (matplotlib, the `plot` extra; headless Agg)."""

from __future__ import annotations

from pathlib import Path


class PlotUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'tensorhub-ros[plot]'") from None
    return plt


def rl(result: dict, path: Path) -> None:
    """Stall seconds (rollouts, trainer) and bytes per topology level: ours vs baseline;
    the title puts what ours gave for its stall (versions skipped, staleness) beside it."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4), dpi=120)
    arms = ("ours", "baseline")
    for i, key in enumerate(("rollout_stall_s", "trainer_stall_s")):
        left.bar([x + i * 0.4 for x in range(2)], [result[a][key] for a in arms], 0.4,
                 label=key.removesuffix("_s").replace("_", " "))
    left.set_xticks([0.2, 1.2], arms)
    left.set_ylabel("seconds (summed)")
    left.legend()
    levels = ("node", "rack", "dc", "remote")
    for i, arm in enumerate(arms):
        right.bar([x + i * 0.4 for x in range(4)], [result[arm]["bytes_by_level"][lv] / 1e6 for lv in levels],
                  0.4, label=arm)
    right.set_xticks([x + 0.2 for x in range(4)], levels)
    right.set_ylabel("MB planned")
    right.legend()
    stale = result.get("mean_staleness", {})
    fig.suptitle(f"rl {result['workload']}: rollout stall ratio {result['stall_ratio']}, "
                 f"versions ours skipped {result.get('versions_skipped', 0)}, mean staleness "
                 f"ours {stale.get('ours')} / baseline {stale.get('baseline')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def fanout(result: dict, path: Path) -> None:
    """Completion time vs readers: ours, star, the gloo broadcast (rows that carry it),
    and the S/B line when the rows carry it."""
    plt = _pyplot()
    rows = result["rows"]
    readers = [r["readers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(readers, [r["ours_s"] for r in rows], "o-", label="ours (ROS: readers relay)")
    ax.plot(readers, [r["star_s"] for r in rows], "s--", label="star (all from the publisher)")
    if "broadcast_s" in rows[0]:
        ax.plot(readers, [r["broadcast_s"] for r in rows], "^-.", label="gloo broadcast (same bytes, same nodes)")
    if "bound_s" in rows[0]:
        ax.plot(readers, [r["bound_s"] for r in rows], ":", color="gray", label="S / node link rate")
    ax.set_xlabel("readers")
    ax.set_ylabel("seconds until every reader has the version")
    ax.set_xticks(readers)
    ax.set_ylim(bottom=0)
    warm = " (warm)" if result.get("warmup") else ""
    ax.set_title(f"fan-out of {result['bytes'] / 2**20:.0f} MiB{warm}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
