"""Faults of the bytes: a holder serving flipped bits; a read that outlives its timeout;
a NIXL read given up while its holder is stalled."""

from __future__ import annotations

import time

from ..rig import Driven, RigError
from .rows import Run, fetch_row, row


def corrupt_chunk(r: Run, bad: Driven, good: Driven, reader: Driven) -> dict:
    r.publish(bad, "cc", 1)
    base = r.unfaulted("corrupt_chunk", reader, "cc", 1)
    failed0 = r.counters().get("reads_failed", 0)
    flipped = bad.ask("corrupt", model="cc", version=1)["corrupted"]
    r.send_fetch(reader, "cc", 1)
    r.wait(lambda: r.counters().get("reads_failed", 0) > failed0, "the hub to count the corrupt read")
    t_good = time.monotonic()
    r.publish(good, "cc", 1)  # a clean holder of the same bytes appears
    res = reader.recv(r.timeout + 30)
    if res.get("error"):
        return row("corrupt_chunk", False, 0, None, None, f"fetch failed: {res['error']}")
    detected = res["stats"]["corrupt"] >= 1
    extra = (f"each of {bad.name}'s {flipped} chunks had a flipped byte; reader detected {res['stats']['corrupt']} and "
             f"re-read from {good.name}")
    return fetch_row("corrupt_chunk", res, base["s"], res["t_done"] - t_good, extra, need=detected)


def zombie_read(r: Run, slow: Driven, fast: Driven, reader: Driven) -> dict:
    """A read outlives its timeout: ``slow`` serves a chunk in longer than ``reader``'s
    read timeout, ``fast`` holds the same version. Once the hub counted a read from
    ``slow`` failed (timed out; the fetch re-reads that chunk from ``fast``), ``slow``
    unpublishes the version and, the moment that returns, overwrites its tensors.
    Contract 3: that unpublish may return only once no read from ``slow`` can still
    touch either buffer (a late one would land garbage in the reader), so the fetch
    must end with the published bytes. recovery_s: how long the unpublish waited;
    slowdown: the fetch against an unfaulted one of the same size from ``fast``."""
    r.publish(fast, "zr", 1)
    base = r.unfaulted("zombie_read", reader, "zr", 1)
    r.unpublish(fast, "zr", 1)
    r.publish(slow, "zr", 2)
    r.publish(fast, "zr", 2)
    failed = r.counters().get("reads_failed", 0)
    r.send_fetch(reader, "zr", 2)
    try:
        r.wait(lambda: r.counters().get("reads_failed", 0) > failed, f"a read from {slow.name} to time out",
               timeout=min(r.timeout, 60))
        landed = True
    except RigError:
        landed = False  # the planner read nothing from the slow holder
    slow.send("unpublish", model="zr", version=2, timeout=r.timeout, overwrite=True)
    res = reader.recv(r.timeout + 30)
    gone = slow.recv(r.timeout + 30)
    if gone.get("error") or gone.get("trace"):
        return row("zombie_read", False, 0, None, None, f"{slow.name}'s unpublish failed: {gone.get('error')}")
    extra = (f"a read from {slow.name} timed out, {slow.name} unpublished (waited {gone['s']:.2f}s) and overwrote "
             "its tensors while the fetch went on" if landed else f"no read from {slow.name} timed out (no zombie)")
    return fetch_row("zombie_read", res, base["s"], gone["s"], extra, need=landed)


def nixl_giveup(r: Run, stalled: Driven, other: Driven, reader: Driven, stall_s: float) -> dict:
    """A NIXL read given up while its holder is stalled, then the holder resumes.
    ``stalled`` and ``other`` hold ``ng@1``; ``reader`` (read timeout below
    ``stall_s``), never connected to ``stalled`` before (a connection needs the
    holder's progress to set up; once set up, shared-memory GETs on one host do not),
    fetches it while ``stalled`` serves nothing for ``stall_s`` (its progress held up;
    its process and peer channel run). Its reads from ``stalled`` time out and are
    given up: releasing a GET does not stop it over UCX, so the engine stops it by
    disconnecting that holder and counts it over only once NIXL reports it final; its
    source stays pinned until then (contract 3). Meanwhile ``stalled`` unpublishes
    ``ng@1`` and overwrites its tensors the moment that returns. Once it resumed, the
    reader's destination is counted again: lost_bytes is the larger count.
    recovery_s: how long that unpublish waited."""
    r.publish(other, "ng", 1)
    base = r.unfaulted("nixl_giveup", reader, "ng", 1)  # (before ``stalled`` holds it: no connection to it yet)
    r.publish(stalled, "ng", 1)
    until = stalled.ask("stall", seconds=stall_s)["until"]
    r.send_fetch(reader, "ng", 1)
    time.sleep(stall_s / 2)  # (past the reader's read timeout: its reads from the stalled holder were given up)
    stalled.send("unpublish", model="ng", version=1, timeout=r.timeout, overwrite=True)
    res = reader.recv(r.timeout + 30)
    gone = stalled.recv(r.timeout + 30)
    time.sleep(max(0.0, until - time.monotonic()) + 0.5)  # (resumed: a late GET would land within milliseconds)
    later = reader.ask("recount", model="ng", version=1, mib=r.mib)["lost_bytes"]
    if gone.get("error"):
        return row("nixl_giveup", False, 0, None, None, f"{stalled.name}'s unpublish failed: {gone['error']}")
    if not res.get("error"):
        res = {**res, "lost_bytes": max(res["lost_bytes"], later)}
    given_up = res.get("stats", {}).get("failed", 0) > 0
    extra = (f"{stalled.name} stalled {stall_s:.1f}s mid-fetch; the reader gave its reads from it up; "
             f"{stalled.name} unpublished (waited {gone['s']:.2f}s, "
             f"{'after' if gone['t_done'] >= until else 'before'} it resumed) and overwrote its tensors; "
             f"lost bytes counted again once it resumed: {later}" if given_up
             else f"no read from {stalled.name} was given up")
    return fetch_row("nixl_giveup", res, base["s"], gone["s"], extra, need=given_up)
