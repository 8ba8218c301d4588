"""PNG charts for `th bench … --plot` (matplotlib, the `plot` extra; headless Agg)."""

from __future__ import annotations

from pathlib import Path


class PlotUnavailable(RuntimeError):
    pass


def fanout(result: dict, path: Path) -> None:
    """Completion time vs readers: ours, star, and the S/B line when the rows carry it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'tensorhub[plot]'") from None
    rows = result["rows"]
    readers = [r["readers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(readers, [r["ours_s"] for r in rows], "o-", label="ours (ROS: readers relay)")
    ax.plot(readers, [r["star_s"] for r in rows], "s--", label="star (all from the publisher)")
    if "bound_s" in rows[0]:
        ax.plot(readers, [r["bound_s"] for r in rows], ":", color="gray", label="S / node link rate")
    ax.set_xlabel("readers")
    ax.set_ylabel("seconds until every reader has the version")
    ax.set_xticks(readers)
    ax.set_ylim(bottom=0)
    ax.set_title(f"fan-out of {result['bytes'] / 2**20:.0f} MiB")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
