"""What every fault row shares: the run's hub client and sizes (``Run``), and the row itself."""

from __future__ import annotations

import time

from ...hub import protocol as p
from ...hub.client import HubClient, HubError, HubUnreachable
from ..rig import Driven, HubProcess, RigError

CHUNKS = 64
POLL_S = 0.01
HEARTBEAT_S = 0.2  # the driven endpoints' heartbeat
EXPIRY_S = 2.0  # the hub drops a silent endpoint after this; also its grace after a restart
REBUILD_S = 10 * EXPIRY_S  # a restarted hub's registry must be rebuilt within this
# A fault lands once the reader's beats (every ``HEARTBEAT_S``: ``Heartbeat.filling``)
# say it holds this share: mid-read, as its fetch reports to the hub only at its end.
MID_FETCH = 0.25


class Run:
    def __init__(self, hub: HubProcess, mib: float, window: int, timeout: float):
        self.hub, self.mib, self.window, self.timeout = hub, mib, window, timeout
        self.nbytes = int(mib * 2**20) // 16 * 16
        self.chunk_mib = max(self.nbytes // CHUNKS, 4096) / 2**20
        self.client = HubClient(hub.address, hub.token)

    def reconnect(self) -> None:
        self.client.close()
        self.client = HubClient(self.hub.address, self.hub.token)

    def versions(self, model: str):
        try:
            return self.client.call(p.Versions(model=model), timeout=2).versions
        except (HubError, HubUnreachable):
            return []

    def held(self, model: str, version: int, name: str) -> int:
        for v in self.versions(model):
            if v.version == version:
                return next((h.held_bytes for h in v.holders if h.name == name), 0)
        return 0

    def counters(self) -> dict:
        return self.client.call(p.Status(), timeout=5).counters

    def wait(self, predicate, what: str, timeout: float | None = None):
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(POLL_S)
        raise RigError(f"timed out after {timeout or self.timeout:.0f}s waiting for {what}")

    def wait_held(self, model: str, version: int, reader: Driven, fraction: float) -> int:
        return self.wait(lambda: (h := self.held(model, version, reader.name)) >= fraction * self.nbytes and h,
                         f"{reader.name} to hold {fraction:.0%} of {model}@{version}")

    # each op through the driven processes, with the run's sizes; ``timeout`` is the
    # operation's own (sent along), the answer is awaited a little longer
    def _call(self, who: Driven, op: str, **args) -> dict:
        who.send(op, timeout=self.timeout, **args)
        res = who.recv(self.timeout + 30)
        if res.get("trace"):
            raise RigError(f"{who.name}: {op} raised {res['type']}: {res['error']}")
        return res

    def publish(self, who: Driven, model: str, version: int) -> None:
        who.ask("publish", model=model, version=version, mib=self.mib, chunk_mib=self.chunk_mib,
                timeout=self.timeout)

    def fetch(self, who: Driven, model: str, version: int, window: int | None = None) -> dict:
        return self._call(who, "fetch", model=model, version=version, mib=self.mib, window=window or self.window)

    def pid(self, name: str) -> int:
        """The pid of the process the hub lists under ``name`` (0 if none)."""
        return next((e.pid for e in self.client.call(p.Status(), timeout=5).endpoints if e.name == name), 0)

    def unfaulted(self, fault: str, reader: Driven, model: str, version: int) -> dict:
        """The fetch a row compares against: it must end with the published bytes; the
        reader's copy is then unpublished, so the faulted fetch reads from the holders."""
        base = self.fetch(reader, model, version)
        if base.get("error") or base["lost_bytes"]:
            raise RigError(f"{fault} setup: unfaulted fetch by {reader.name}: {base}")
        self.unpublish(reader, model, version)
        return base

    def beat_age(self, name: str) -> float:
        """Seconds since the hub last heard from ``name`` (inf if it does not list it)."""
        eps = self.client.call(p.Status(), timeout=5).endpoints
        return next((e.heartbeat_age_s for e in eps if e.name == name), float("inf"))

    def send_fetch(self, who: Driven, model: str, version: int) -> None:
        who.send("fetch", model=model, version=version, mib=self.mib, window=self.window, timeout=self.timeout)

    def unpublish(self, who: Driven, model: str, version: int) -> dict:
        return self._call(who, "unpublish", model=model, version=version)


def row(fault: str, ok: bool, lost: int, recovery: float | None, slowdown: float | None, detail: str) -> dict:
    return {"fault": fault, "ok": bool(ok), "lost_bytes": int(lost),
            "recovery_s": None if recovery is None else round(recovery, 3),
            "slowdown": None if slowdown is None else round(slowdown, 3), "detail": detail}


def fetch_row(fault: str, res: dict, base_s: float, recovery: float | None, extra: str, need=True) -> dict:
    if res.get("error"):
        return row(fault, False, 0, None, None, f"fetch failed: {res['error']}")
    lost = res["lost_bytes"]
    ok = need and lost == 0 and res.get("version") is not None
    st = res["stats"]
    detail = (f"{extra}; fetch {res['s']:.2f}s vs {base_s:.2f}s unfaulted; {st['reads']} reads, {st['failed']} failed, "
              f"{st['corrupt']} corrupt")
    return row(fault, ok, lost, recovery, res["s"] / base_s, detail)
