"""The delta rows of ``th bench rl --workload cross-dc``: ours with deltas, ours without,
and the baseline, on a WAN slower than the racks (``--testbed --wan-mbit``).

Protocol. ``WanMeter`` reads the kernel's byte counter of the remote DC's link (what
went down into that DC: every copy that crossed) each time the trainer publishes and
once after the arm, so a version's WAN bytes are those between its publish and the
next one's (the trainer's step is paced longer than a crossing, so they do not mix).
It samples on a thread that looks at the trainer's events every 50 ms; on loopback
(no link) it measures nothing and the rows say null. ``arm_rows`` turns one arm's
events into per-version rows; ``summary`` is the ``delta`` section: the ratios over
versions 2.. (version 1 has nothing to be a delta against, in every arm).

- ``wan_bytes_ratio``: WAN bytes per version with deltas ÷ the full version's bytes.
- ``stall_ratio``: the remote rollouts' wait for a version with deltas ÷ without it.
  A remote rollout's wait for v is from v's publish until its last remote rollout
  held v verified and checked (``began + fetch_s`` of its ``loaded``): what an
  on-policy rollout stalls for. (Double-buffered rollouts generate meanwhile; their
  swap stall is ``rollout_stall_s``, reported per arm as ever.)
"""

from __future__ import annotations

import threading
from typing import Callable, Optional


class WanMeter:
    def __init__(self, read: Optional[Callable[[], int]], published: Callable[[], list[dict]]):
        """``read``: the counter (None: nothing to measure); ``published``: the trainer's
        ``published`` events so far."""
        self._read, self._published = read, published
        self.samples: dict[int, int] = {}  # version -> the counter when its publish was seen
        self.end: Optional[int] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="th-wan-meter", daemon=True)

    def __enter__(self) -> "WanMeter":
        self.start = self._read() if self._read else None
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._read:
            self.end = self._read()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for e in self._published():
                if e["version"] not in self.samples and self._read:
                    self.samples[e["version"]] = self._read()

    def by_version(self) -> dict[int, Optional[int]]:
        """Each version's WAN bytes: from its publish to the next (the last: to the end)."""
        if not self._read or self.end is None:
            return {v: None for v in self.samples}
        marks = sorted(self.samples.items())
        out = {}
        for i, (v, at) in enumerate(marks):
            nxt = marks[i + 1][1] if i + 1 < len(marks) else self.end
            out[v] = nxt - at
        return out


def arm_rows(meter: WanMeter, published: list[dict], remote_loads: list[dict]) -> dict:
    """Per version: WAN bytes, the remote rollouts' wait, and their delta reads."""
    at = {e["version"]: e["published_at"] for e in published}
    wan = meter.by_version()
    rows = {}
    for v in sorted(at):
        loads = [e for e in remote_loads if e["version"] == v]
        rows[str(v)] = {
            "wan_bytes": wan.get(v),
            "remote_wait_s": round(max(e["began"] + e["fetch_s"] - at[v] for e in loads), 4) if loads else None,
            "remote_loads": len(loads),
            "delta_reads": sum(e.get("delta_reads", 0) for e in loads),
            "delta_wire_bytes": sum(e.get("delta_wire_bytes", 0) for e in loads),
            "delta_failed": sum(e.get("delta_failed", 0) for e in loads),
        }
    return rows


def summary(deltas: dict, full: dict, version_bytes: int) -> dict:
    """The ``delta`` section from the two arms of ours (with and without deltas)."""
    later = [v for v in deltas if int(v) >= 2 and v in full]
    wan = [deltas[v]["wan_bytes"] for v in later]
    waits = [(deltas[v]["remote_wait_s"], full[v]["remote_wait_s"]) for v in later]
    waits = [(a, b) for a, b in waits if a is not None and b is not None]
    return {
        "versions": later,
        "wan_bytes_ratio": round(sum(wan) / (len(wan) * version_bytes), 4)
        if wan and None not in wan and version_bytes else None,
        "wan_bytes_ratio_vs_full_arm": round(sum(wan) / sum(full[v]["wan_bytes"] for v in later), 4)
        if wan and None not in wan and all(full[v]["wan_bytes"] for v in later) else None,
        "stall_ratio": round(sum(a for a, _ in waits) / sum(b for _, b in waits), 4)
        if waits and sum(b for _, b in waits) > 0 else None,
        "delta_failed": sum(deltas[v]["delta_failed"] for v in deltas),
    }
