"""`th bench faults`: inject one fault per row into real processes on loopback and check
that the contract it threatens held.

Protocol. One hub (``rig.HubProcess``: it can be killed -9 and started again on the
same address and token) and five endpoint processes (``rig.Driven``, running this
module: ``bench.peer``'s ops plus ``corrupt``, ``peer_address`` and a ``fetch`` that
zeroes its destination first and counts lost bytes). Each fault uses its own model, so
rows do not share replicas. Payload: ``mib`` MiB in 4 int32 tensors built from the
version number (every process can rebuild the published bytes), cut into 64 chunks.
Holders that must be slow enough to fault mid-read serve at a throttled rate
(``TH_TEST_SERVE_BPS``, per connection) chosen so that an unfaulted fetch takes about
``TARGET_S`` seconds; that hook only acts on tcp serving, so with ``--engine nixl`` a
fetch is fast and a mid-read fault may land late (the row says where it landed).

Each row: ``fault``, ``ok`` (the contract held), ``lost_bytes`` (bytes of the reader's
destination that differ from the published tensors after the fetch returned, counted
against the rebuilt tensors byte by byte: 0 is the only acceptable value),
``recovery_s``, ``slowdown`` (the faulted operation's time ÷ the same operation without
the fault, both measured in this run, by the same processes) and ``detail``.

Faults (in this order):

- ``kill_source``: a publisher and a complete second holder; a reader fetches with a
  small window; when the hub shows the reader holding half the bytes, the holder that
  served most of the reader's unfaulted fetch is killed -9. The fetch must complete
  from the other holder. recovery_s = (completion − kill) − T₀·(1 − f), with T₀ the
  unfaulted fetch time and f the fraction held at the kill: the time beyond what the
  rest of an unfaulted fetch would have taken (about 0 on loopback, where the throttle
  is per connection: the survivor serves the whole window as fast as both did; it can
  be slightly negative, timing noise).
- ``kill_reader``: a reader is killed -9 mid-read; its source's ``unpublish`` (issued
  right after the kill) must still complete within ``timeout`` once the hub expires
  the reader and drops its pins. recovery_s = unpublish's return − kill; slowdown =
  that unpublish's time ÷ an unpublish with no read in flight. lost_bytes is 0 by
  construction (no reader accepted bytes).
- ``corrupt_chunk``: the only holder flips one byte of every chunk it serves (after
  its checksums were taken); once the hub counted the reader's failed read, a clean
  holder of the same version appears. The reader must detect the corruption (its
  ``corrupt`` count ≥ 1), re-read elsewhere and end with the published bytes.
  recovery_s = completion − the clean holder's publish.
- ``kill_hub``: the hub is killed -9 when the reader holds half the bytes, and started
  again on the same address and token. recovery_s = until the registry is rebuilt (the
  version READY again, listing the publisher and the reader as holders); the fetch must
  complete with the published bytes.
- ``bad_token``: from the fetch's start until it returns, requests with a wrong token
  go, one at a time, alternately to the hub and to the holder's peer channel; each
  must be refused (``auth``), the hub's ``errors.auth`` counter must grow by exactly
  the hub's share, at least one of each must be answered while the fetch ran, and the
  fetch must end with the published bytes.
- ``garbage_frames``: the same with undecodable frames (hub: ``errors.malformed``;
  holder: a ``Refused`` ``malformed`` answer).

For the last two recovery_s is 0 (nothing is lost to recover).
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import msgspec
import torch
import zmq

from ..engines import wire
from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable
from .peer import Peer, serve, tensors
from .rig import Driven, HubProcess, RigError

FAULTS = ["kill_source", "kill_reader", "corrupt_chunk", "kill_hub", "bad_token", "garbage_frames"]
TARGET_S = 2.0  # an unfaulted throttled fetch takes about this long
CHUNKS = 64
POLL_S = 0.01
EXPIRY_S = 2.0  # the hub drops a silent endpoint after this; also its grace after a restart
REBUILD_S = 10 * EXPIRY_S  # a restarted hub's registry must be rebuilt within this


# --- the endpoint process ------------------------------------------------------------

class FaultPeer(Peer):
    def __init__(self, ep):
        super().__init__(ep)
        self.dsts: dict[str, dict] = {}

    def fetch(self, model: str, version: int, mib: float, window: int = 4, timeout: float = 300) -> dict:
        want = tensors(mib, version)
        dst = self.dsts.get(model)
        if dst is None:
            dst = self.dsts[model] = {k: torch.zeros_like(v) for k, v in want.items()}
        else:  # a stale copy must not hide lost bytes
            for t in dst.values():
                t.zero_()
        t0 = time.monotonic()
        try:
            got = self.ep.fetch(model, version, into=dst, window=window, timeout=timeout)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "t_done": time.monotonic(), "s": time.monotonic() - t0}
        t1 = time.monotonic()
        lost = sum(int((dst[k].view(torch.uint8) != v.view(torch.uint8)).sum()) for k, v in want.items())
        return {"version": got, "s": t1 - t0, "t_done": t1, "lost_bytes": lost, "stats": self.ep.last_fetch}

    def unpublish(self, model: str, version: int, timeout: float = 60) -> dict:
        t0 = time.monotonic()
        try:
            self.ep.unpublish(model, version, timeout=timeout)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "t_done": time.monotonic()}
        self.mine.pop((model, version), None)
        return {"s": time.monotonic() - t0, "t_done": time.monotonic()}

    def corrupt(self, model: str, version: int) -> dict:
        """Flip one byte of every chunk we hold (the test hook of tests/integration/worker.py)."""
        views = self.ep._replicas[(model, version)].placed.views
        for view in views:
            view[0] = (int(view[0]) + 1) % 256
        return {"corrupted": len(views)}

    def peer_address(self) -> dict:
        return {"address": self.ep.peer.address}


def main() -> int:
    return serve(FaultPeer, heartbeat_s=0.2)


# --- the workload --------------------------------------------------------------------

class _Run:
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

    def send_fetch(self, who: Driven, model: str, version: int) -> None:
        who.send("fetch", model=model, version=version, mib=self.mib, window=self.window, timeout=self.timeout)

    def unpublish(self, who: Driven, model: str, version: int) -> dict:
        return self._call(who, "unpublish", model=model, version=version)


def _row(fault: str, ok: bool, lost: int, recovery: float | None, slowdown: float | None, detail: str) -> dict:
    return {"fault": fault, "ok": bool(ok), "lost_bytes": int(lost),
            "recovery_s": None if recovery is None else round(recovery, 3),
            "slowdown": None if slowdown is None else round(slowdown, 3), "detail": detail}


def _fetch_row(fault: str, res: dict, base_s: float, recovery: float | None, extra: str, need=True) -> dict:
    if res.get("error"):
        return _row(fault, False, 0, None, None, f"fetch failed: {res['error']}")
    lost = res["lost_bytes"]
    ok = need and lost == 0 and res.get("version") is not None
    st = res["stats"]
    detail = (f"{extra}; fetch {res['s']:.2f}s vs {base_s:.2f}s unfaulted; {st['reads']} reads, {st['failed']} failed, "
              f"{st['corrupt']} corrupt")
    return _row(fault, ok, lost, recovery, res["s"] / base_s, detail)


def _kill_source(r: _Run, procs: dict) -> tuple[dict, Driven]:
    a, b, reader = procs["pubA"], procs["holderB"], procs["reader"]
    r.publish(a, "ks", 1)
    done = r.fetch(b, "ks", 1, window=16)
    if done.get("error") or done["lost_bytes"]:
        raise RigError(f"kill_source setup: {b.name} fetch: {done}")
    base = r.fetch(reader, "ks", 1)
    if base.get("error") or base["lost_bytes"]:
        raise RigError(f"kill_source setup: unfaulted fetch: {base}")
    r.unpublish(reader, "ks", 1)
    # kill the holder that served most of the unfaulted fetch
    victim, survivor = (a, b) if base["stats"]["from_publishers"] * 2 > r.nbytes else (b, a)
    r.send_fetch(reader, "ks", 1)
    held = r.wait_held("ks", 1, reader, 0.5)
    f = min(held / r.nbytes, 1.0)
    t_kill = time.monotonic()
    victim.kill()
    res = reader.recv(r.timeout + 30)
    if res.get("error"):
        why = f"fetch failed after killing {victim.name}: {res['error']}"
        return _row("kill_source", False, 0, None, None, why), survivor
    recovery = (res["t_done"] - t_kill) - base["s"] * (1 - f)
    landed = f < 1.0
    extra = (f"killed {victim.name} at {f:.0%} of the read ({res['stats']['failed']} reads in flight failed)"
             if landed else "the fetch finished before the kill landed (no mid-read fault)")
    return _fetch_row("kill_source", res, base["s"], recovery, extra, need=landed), survivor


def _kill_reader(r: _Run, source: Driven, victim: Driven) -> dict:
    r.publish(source, "kr", 1)
    base = r.unpublish(source, "kr", 1)  # no read in flight
    if base.get("error"):
        raise RigError(f"kill_reader setup: unfaulted unpublish: {base['error']}")
    r.publish(source, "kr", 2)
    r.send_fetch(victim, "kr", 2)
    held = r.wait_held("kr", 2, victim, 0.5)
    t_kill = time.monotonic()
    victim.kill()
    res = r.unpublish(source, "kr", 2)
    if res.get("error"):
        return _row("kill_reader", False, 0, None, None, f"unpublish after the kill failed: {res['error']}")
    gone = victim.name not in [e.name for e in r.client.call(p.Status(), timeout=5).endpoints]
    recovery = res["t_done"] - t_kill
    ok = held < r.nbytes and gone and recovery < r.timeout
    detail = (f"killed {victim.name} at {held / r.nbytes:.0%} of its read; {source.name}'s unpublish returned "
              f"{recovery:.2f}s after the kill (hub expiry {EXPIRY_S}s); reader expired: {gone}")
    return _row("kill_reader", ok, 0, recovery, res["s"] / max(base["s"], 1e-6), detail)


def _corrupt_chunk(r: _Run, bad: Driven, good: Driven, reader: Driven) -> dict:
    r.publish(bad, "cc", 1)
    base = r.fetch(reader, "cc", 1)
    if base.get("error") or base["lost_bytes"]:
        raise RigError(f"corrupt_chunk setup: unfaulted fetch: {base}")
    r.unpublish(reader, "cc", 1)
    failed0 = r.counters().get("reads_failed", 0)
    flipped = bad.ask("corrupt", model="cc", version=1)["corrupted"]
    r.send_fetch(reader, "cc", 1)
    r.wait(lambda: r.counters().get("reads_failed", 0) > failed0, "the hub to count the corrupt read")
    t_good = time.monotonic()
    r.publish(good, "cc", 1)  # a clean holder of the same bytes appears
    res = reader.recv(r.timeout + 30)
    if res.get("error"):
        return _row("corrupt_chunk", False, 0, None, None, f"fetch failed: {res['error']}")
    detected = res["stats"]["corrupt"] >= 1
    extra = (f"each of {bad.name}'s {flipped} chunks had a flipped byte; reader detected {res['stats']['corrupt']} and "
             f"re-read from {good.name}")
    return _fetch_row("corrupt_chunk", res, base["s"], res["t_done"] - t_good, extra, need=detected)


def _kill_hub(r: _Run, source: Driven, reader: Driven) -> dict:
    r.publish(source, "kh", 1)
    base = r.fetch(reader, "kh", 1)
    if base.get("error") or base["lost_bytes"]:
        raise RigError(f"kill_hub setup: unfaulted fetch: {base}")
    r.unpublish(reader, "kh", 1)
    r.send_fetch(reader, "kh", 1)
    held = r.wait_held("kh", 1, reader, 0.5)
    t_kill = time.monotonic()
    r.hub.kill()
    r.hub.start()
    r.reconnect()

    def rebuilt() -> bool:
        for v in r.versions("kh"):
            names = {h.name for h in v.holders}
            return v.state == "READY" and {source.name, reader.name} <= names
        return False

    try:
        r.wait(rebuilt, "the restarted hub to list kh@1 READY with its holders again", timeout=REBUILD_S)
        res_rebuilt, t_rebuilt = True, time.monotonic()
    except RigError:
        res_rebuilt, t_rebuilt = False, None
    res = reader.recv(r.timeout + 30)
    landed = held < r.nbytes
    extra = (f"hub killed -9 at {held / r.nbytes:.0%} of the read and restarted; registry rebuilt: {res_rebuilt}"
             if landed else "the fetch finished before the hub was killed (no mid-read fault)")
    return _fetch_row("kill_hub", res, base["s"], None if t_rebuilt is None else t_rebuilt - t_kill, extra,
                      need=landed and res_rebuilt)


def _refused_peer(address: str, body: bytes) -> str:
    """Send one frame to a holder's peer channel → the refusal code it answers."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(len(body).to_bytes(4, "big") + body)
        answer = wire.recv_answer(sock)
    return getattr(answer.body, "code", type(answer.body).__name__)


def _refused_hub(r: _Run, frames: list[bytes]) -> str:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(r.hub.address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(5000):
            return "no reply"
        body = p.decode_reply(sock.recv()).body
        return getattr(body, "code", type(body).__name__)
    finally:
        sock.close()


def _spam(fault: str, r: _Run, source: Driven, reader: Driven, model: str, base_s: float) -> dict:
    peer = source.ask("peer_address")["address"]
    if fault == "bad_token":
        want = "auth"
        hub_frames = [p.encode(p.Request(v=p.PROTOCOL_VERSION, token="x" * 32, rid=1, op=p.Status()))]
        peer_body = msgspec.msgpack.encode(wire.Ask(v=wire.WIRE_VERSION, token="x" * 32,
                                                    op=wire.Describe(model=model, version=1)))
    else:
        want = "malformed"
        hub_frames = [b"\x00garbage\xff"]
        peer_body = b"\x00garbage\xff" * 3
    before = r.counters().get(f"errors.{want}", 0)
    sent: list[tuple[float, str, str]] = []  # (when answered, channel, refusal code)
    stop = threading.Event()

    def spam() -> None:  # alternately the hub and the holder, until the fetch returned
        while not stop.is_set():
            sent.append((time.monotonic(), "hub", _refused_hub(r, hub_frames)))
            sent.append((time.monotonic(), "peer", _refused_peer(peer, peer_body)))

    t_start = time.monotonic()
    r.send_fetch(reader, model, 1)
    thread = threading.Thread(target=spam, daemon=True)
    thread.start()
    try:
        res = reader.recv(r.timeout + 30)
    finally:
        stop.set()
        thread.join(15)
    if thread.is_alive():
        raise RigError(f"{fault}: the refused requests to the hub and {source.name} did not end within 15s")
    counted = r.counters().get(f"errors.{want}", 0) - before
    hub_sent = sum(1 for _, ch, _ in sent if ch == "hub")
    t_done = res.get("t_done", time.monotonic())
    during = {ch: sum(1 for t, c, _ in sent if c == ch and t_start <= t <= t_done) for ch in ("hub", "peer")}
    refused = all(code == want for _, _, code in sent)
    extra = (f"{hub_sent} to the hub and {len(sent) - hub_sent} to {source.name}'s peer channel "
             f"({during['hub']} and {during['peer']} while the fetch ran), all refused {want}: {refused}; "
             f"hub errors.{want} +{counted:.0f}")
    ok = refused and counted == hub_sent and min(during.values()) >= 1
    return _fetch_row(fault, res, base_s, 0.0, extra, need=ok)


def run(mib: float = 64, engine: str = "tcp", timeout: float = 120, window: int = 2,
        faults: list[str] | None = None) -> dict:
    faults = faults or FAULTS
    nbytes = int(mib * 2**20) // 16 * 16
    slow = {"TH_TEST_SERVE_BPS": str(max(1, int(nbytes / (window * TARGET_S))))}
    rows: list[dict] = []
    with HubProcess(expiry_s=EXPIRY_S) as hub:
        r = _Run(hub, mib, window, timeout)
        args = ["--hub", hub.address, "--token", hub.token, "--engine", engine]

        def spawn(name: str, env: dict | None = None) -> Driven:
            return Driven(name, ["-m", "tensorhub_cli.bench.faults", "--name", name, *args], env=env)

        procs: dict[str, Driven] = {}
        try:
            for name, env in [("pubA", slow), ("holderB", slow), ("reader", None), ("victim", None),
                              ("reader2", None)]:
                procs[name] = spawn(name, env)
            engines = {d.hello["engine"] for d in procs.values()}  # all start in parallel; wait for each
            survivor = procs["pubA"]
            if "kill_source" in faults:
                row, survivor = _kill_source(r, procs)
                rows.append(row)
            if "kill_reader" in faults:
                rows.append(_kill_reader(r, survivor, procs["victim"]))
            if "corrupt_chunk" in faults:
                rows.append(_corrupt_chunk(r, survivor, procs["reader"], procs["reader2"]))
            if "kill_hub" in faults:
                rows.append(_kill_hub(r, survivor, procs["reader2"]))
            spam = [f for f in ("bad_token", "garbage_frames") if f in faults]
            if spam:
                r.publish(survivor, "bt", 1)
                base = r.fetch(procs["reader2"], "bt", 1)
                if base.get("error") or base["lost_bytes"]:
                    raise RigError(f"bad_token setup: unfaulted fetch: {base}")
                for fault in spam:
                    r.unpublish(procs["reader2"], "bt", 1)
                    rows.append(_spam(fault, r, survivor, procs["reader2"], "bt", base["s"]))
        finally:
            r.client.close()
            for d in procs.values():
                if d.proc.poll() is None:
                    d.kill()  # nothing to drain: the run is over (and a clean close can wait on a dead hub)
                d.stop()
    return {"workload": "faults", "bytes": nbytes, "engine": ",".join(sorted(engines)), "window": window,
            "throttle_bps": int(slow["TH_TEST_SERVE_BPS"]), "rows": rows, "ok": all(row["ok"] for row in rows)}


if __name__ == "__main__":
    sys.exit(main())
