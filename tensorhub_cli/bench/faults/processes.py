"""Faults of whole processes: a source, a reader or the hub killed -9 mid-read; the agent
holding the last copy killed -9; a source stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...hub import protocol as p
from ...launch.procs import kill_child, stop_child
from ..rig import Driven, RigError
from .rows import EXPIRY_S, MID_FETCH, HEARTBEAT_S, REBUILD_S, Run, fetch_row, row


def kill_source(r: Run, procs: dict) -> tuple[dict, Driven]:
    a, b, reader = procs["pubA"], procs["holderB"], procs["reader"]
    r.publish(a, "ks", 1)
    done = r.fetch(b, "ks", 1, window=16)
    if done.get("error") or done["lost_bytes"]:
        raise RigError(f"kill_source setup: {b.name} fetch: {done}")
    base = r.unfaulted("kill_source", reader, "ks", 1)
    # kill the holder that served most of the unfaulted fetch
    victim, survivor = (a, b) if base["stats"]["from_publishers"] * 2 > r.nbytes else (b, a)
    r.send_fetch(reader, "ks", 1)
    held = r.wait_held("ks", 1, reader, MID_FETCH)
    f = min(held / r.nbytes, 1.0)
    t_kill = time.monotonic()
    victim.kill()
    res = reader.recv(r.timeout + 30)
    if res.get("error"):
        why = f"fetch failed after killing {victim.name}: {res['error']}"
        return row("kill_source", False, 0, None, None, why), survivor
    recovery = (res["t_done"] - t_kill) - base["s"] * (1 - f)
    landed = f < 1.0
    extra = (f"killed {victim.name} at {f:.0%} of the read ({res['stats']['failed']} reads in flight failed)"
             if landed else "the fetch finished before the kill landed (no mid-read fault)")
    return fetch_row("kill_source", res, base["s"], recovery, extra, need=landed), survivor


def kill_reader(r: Run, source: Driven, victim: Driven) -> dict:
    r.publish(source, "kr", 1)
    base = r.unpublish(source, "kr", 1)  # no read in flight
    if base.get("error"):
        raise RigError(f"kill_reader setup: unfaulted unpublish: {base['error']}")
    r.publish(source, "kr", 2)
    r.send_fetch(victim, "kr", 2)
    held = r.wait_held("kr", 2, victim, MID_FETCH)
    t_kill = time.monotonic()
    victim.kill()
    res = r.unpublish(source, "kr", 2)
    if res.get("error"):
        return row("kill_reader", False, 0, None, None, f"unpublish after the kill failed: {res['error']}")
    gone = victim.name not in [e.name for e in r.client.call(p.Status(), timeout=5).endpoints]
    recovery = res["t_done"] - t_kill
    ok = held < r.nbytes and gone and recovery < r.timeout
    detail = (f"killed {victim.name} at {held / r.nbytes:.0%} of its read; {source.name}'s unpublish returned "
              f"{recovery:.2f}s after the kill (hub expiry {EXPIRY_S}s); reader expired: {gone}")
    return row("kill_reader", ok, 0, recovery, res["s"] / max(base["s"], 1e-6), detail)


def kill_hub(r: Run, source: Driven, reader: Driven) -> dict:
    r.publish(source, "kh", 1)
    base = r.unfaulted("kill_hub", reader, "kh", 1)
    r.send_fetch(reader, "kh", 1)
    held = r.wait_held("kh", 1, reader, MID_FETCH)
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
    return fetch_row("kill_hub", res, base["s"], None if t_rebuilt is None else t_rebuilt - t_kill, extra,
                      need=landed and res_rebuilt)


def slow_heartbeat(r: Run, source: Driven, reader: Driven) -> dict:
    """The source is stopped (SIGSTOP) mid-read for ``PAUSE_S``: at least two missed
    heartbeats, yet below the hub's expiry. Contract 3/7: nothing may be dropped — no
    expiry, the source still a holder, its later unpublish a normal one — and the fetch
    ends with the published bytes. recovery_s: SIGCONT until the hub heard it again."""
    pause = max(2 * HEARTBEAT_S, EXPIRY_S / 2)
    r.publish(source, "sh", 1)
    base = r.unfaulted("slow_heartbeat", reader, "sh", 1)
    expiries = r.counters().get("expiries", 0)
    r.send_fetch(reader, "sh", 1)
    held = r.wait_held("sh", 1, reader, MID_FETCH)
    os.kill(source.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(pause)
    finally:
        os.kill(source.proc.pid, signal.SIGCONT)
    t_cont = time.monotonic()
    r.wait(lambda: r.beat_age(source.name) < 2 * HEARTBEAT_S, f"the hub to hear from {source.name} again")
    recovery = time.monotonic() - t_cont
    res = reader.recv(r.timeout + 30)
    expired = int(r.counters().get("expiries", 0) - expiries)
    still = r.held("sh", 1, source.name) == r.nbytes
    after = r.unpublish(source, "sh", 1)
    landed = held < r.nbytes
    # one clock (monotonic) across processes: did the fetch go on only once the holder did?
    during = "" if res.get("error") or res["t_done"] > t_cont else \
        " (the fetch ended while it was stopped: it did not need it)"
    extra = (f"{source.name} stopped {pause:.1f}s at {held / r.nbytes:.0%} of the read{during} (heartbeat {HEARTBEAT_S}s, "
             f"expiry {EXPIRY_S}s): expiries +{expired}, still a full holder: {still}, its unpublish after: "
             f"{after.get('error') or 'ok'}" if landed else "the fetch finished before the stop landed")
    return fetch_row("slow_heartbeat", res, base["s"], recovery, extra,
                     need=landed and expired == 0 and still and not after.get("error"))


def _agent(r: Run, node: str, engine: str, store: str, log) -> subprocess.Popen:
    """A node agent on loopback with its copies under ``store``, started as ``th up`` starts one."""
    return subprocess.Popen([sys.executable, "-m", "tensorhub_cli.agent", "--hub", r.hub.address, "--token-file",
                             str(r.hub.token_file), "--node", node, "--address", "127.0.0.1", "--engine", engine,
                             "--heartbeat-s", str(HEARTBEAT_S), "--store", store, "--cluster", "bench-faults"],
                            stdout=log, stderr=subprocess.STDOUT)


def kill_agent(r: Run, pub: Driven, reader: Driven, engine: str) -> dict:
    """The agent holding the last retained copy is killed -9. A publisher publishes
    ``ka@1`` and unpublishes it, so retention (contract 4) has the node's agent pull the
    only copy left; the reader's unfaulted fetch comes from it. Then the agent is
    killed -9 and started again with the same arguments (what ``th up``'s reconcile
    does): it must re-adopt the copy that survived in its store (``agent.store``),
    checked chunk by chunk, and the version must be READY again, and fetched with the
    published bytes. recovery_s = kill until READY again; slowdown = that fetch against
    the unfaulted one from the same agent."""
    name, node = "agent-nodeK", "nodeK"
    with tempfile.TemporaryDirectory(prefix="th-faults-store-") as store, \
            tempfile.NamedTemporaryFile(prefix="th-faults-agent-", suffix=".log") as log:
        agent = _agent(r, node, engine, store, log)
        try:
            r.wait(lambda: r.beat_age(name) < 1, f"{name} to register")
            r.publish(pub, "ka", 1)
            r.unpublish(pub, "ka", 1)  # acknowledged once the agent's retained copy is complete

            def holders() -> set[str]:
                return next(({h.name for h in v.holders} for v in r.versions("ka")
                             if v.version == 1 and v.state == "READY"), set())
            if holders() != {name}:
                raise RigError(f"kill_agent setup: ka@1 held by {sorted(holders())}, not by {name} alone")
            base = r.unfaulted("kill_agent", reader, "ka", 1)
            t_kill = time.monotonic()
            kill_child(agent)
            files = sum(1 for _ in Path(store).rglob("data"))
            agent = _agent(r, node, engine, store, log)
            try:
                r.wait(lambda: r.pid(name) == agent.pid and holders() == {name},
                       f"ka@1 READY again at the restarted {name}", timeout=REBUILD_S)
                recovery = time.monotonic() - t_kill
            except RigError:
                recovery = None
            res = r.fetch(reader, "ka", 1)
            extra = (f"{name} held the only copy; killed -9, {files} copy file(s) survived in its store, restarted "
                     f"(its successor registers once the hub expired it, {EXPIRY_S}s): "
                     + (f"READY again after {recovery:.2f}s" if recovery is not None else "never READY again"))
            return fetch_row("kill_agent", res, base["s"], recovery, extra, need=recovery is not None and files > 0)
        finally:
            stop_child(agent)
