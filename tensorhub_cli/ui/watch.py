"""`th status --watch`: the status screen, refreshed, with what only a series of
snapshots shows: each endpoint's (agents' too) fetch progress and rate, how long it
has been waiting for weights, and the hub's latest events. On a terminal the screen
is redrawn in place (rich Live); piped or redirected, each refresh is printed in full
after a timestamp line, so a log of it reads as a series of snapshots.

One ``Status`` request per refresh (default 1 s): the hub answers it from its tables
in one pass, so a watching operator costs the hub one small request a second.
Rates and stalls are computed here from consecutive snapshots, not by the hub.
"""

from __future__ import annotations

from rich.console import Group
from rich.progress_bar import ProgressBar

from ..hub import protocol as p
from ..launch.state import ClusterState
from .status import status_parts
from .tables import Grid

EVENTS_SHOWN = 8


class Watch:
    def __init__(self) -> None:
        self._prev: dict[tuple[str, str, int], tuple[float, int]] = {}  # (endpoint, model, version) → (t, bytes)
        self._partial_since: dict[tuple[str, str, int], float] = {}

    def render(self, now: float, state: ClusterState, status: p.StatusReply | None,
               alive: dict[tuple[str, str], bool | None], places: dict[str, tuple[str, str]]) -> Group:
        parts = status_parts(state, status, alive, places, endpoints=self._endpoints(now, status), counters=False)
        if status is not None:
            parts.append(events_table(status.events[-EVENTS_SHOWN:]))
        return Group(*parts)

    def _endpoints(self, now: float, status: p.StatusReply | None) -> Grid:
        # (rack and dc are the nodes table's: left out here, the row reads at 80 columns)
        t = Grid("endpoint", "role", "alive", "holds", "fetching", "progress", "MB/s", "stall", title="endpoints",
                 names=("endpoint", "holds", "fetching"))
        if status is None:
            return t
        complete: dict[str, list[str]] = {}
        partial: dict[str, tuple[p.VersionStatus, int]] = {}
        for v in status.versions:
            for h in v.holders:
                if h.complete:
                    complete.setdefault(h.name, []).append(f"{v.model}@{v.version}")
                else:
                    partial[h.name] = (v, h.held_bytes)
        seen = set()
        for e in status.endpoints:  # agents too: their retained copies and `th sync` fetches are the point
            fetching = bar = rate = stall = ""
            if e.name in partial:
                v, held = partial[e.name]
                key = (e.name, v.model, v.version)
                seen.add(key)
                since = self._partial_since.setdefault(key, now)
                t0, b0 = self._prev.get(key, (now, held))
                self._prev[key] = (now, held)
                fetching = f"{v.model}@{v.version}"
                bar = ProgressBar(total=max(v.nbytes, 1), completed=held, width=10)
                rate = f"{(held - b0) / max(now - t0, 1e-9) / 1e6:.0f}" if now > t0 else "-"
                stall = f"{now - since:.1f}s"
            t.add_row(e.name, e.role or e.kind, "yes" if e.alive else "[red]no[/]",
                      "\n".join(complete.get(e.name, [])[-2:]) or "-", fetching, bar, rate, stall)
        for key in [k for k in self._prev if k not in seen]:  # finished or gone: forget its history
            self._prev.pop(key, None)
            self._partial_since.pop(key, None)
        return t


def events_table(events: list[p.Event]) -> Grid:
    t = Grid("t", "event", "endpoint", "version", "message", title="last events",
             names=("event", "endpoint", "version"))
    for ev in events:
        t.add_row(f"{ev.t:.1f}s", ev.kind, ev.endpoint or "-", f"{ev.model}@{ev.version}" if ev.model else "-",
                  ev.message[:80])
    return t
