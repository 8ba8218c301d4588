"""Faults of the bytes: a holder serving flipped bits; a read that outlives its timeout."""

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
