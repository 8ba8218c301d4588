"""The holder side of a delta read (``engines.wire.ReadDelta``): a chunk of v+1 encoded
against the same chunk of a base version this endpoint also holds.

Protocol. ``answer(replica, ask)`` (``replica``: the endpoint's lookup of a held
version) returns the answer's head and its payload: ``DeltaBytes`` and the delta
(``tensorhub_cli.delta.encode``), or the chunk itself (``full``) where a delta would not
be smaller; or ``Refused`` naming what is missing. It serves only chunks held whole and
verified in both versions (a publisher: its whole shard), so the bytes it encodes are
immutable while referenced (contract 3); it keeps references to both chunks' tensors
for the encode, so neither buffer is freed under it. It runs the encode on the caller's
thread: the peer server calls it off its event loop. Device memory is copied to host
first (the codec reads host memory).
"""

from __future__ import annotations

from typing import Callable, Optional

from .. import delta
from ..engines import wire
from .replica import Replica


def answer(replica: Callable[[tuple[str, int]], Optional[Replica]], ask: wire.ReadDelta
           ) -> tuple[wire.DeltaBytes | wire.Refused, bytes]:
    what = f"{ask.model}@{ask.version} chunk {ask.index} against @{ask.base}"
    if ask.base >= ask.version:
        return wire.Refused(code="bad_request", message=f"delta of {what}: base must be older than version"), b""
    chunks = []
    for number in (ask.base, ask.version):
        held = replica((ask.model, number))
        view = whole(held, ask.index)
        if view is None:
            return wire.Refused(code="not_found", message=f"delta of {what}: this endpoint does not hold "
                                f"chunk {ask.index} of {ask.model}@{number} whole"), b""
        chunks.append(view)
    old, new = (t if t.device.type == "cpu" else t.cpu() for t in chunks)
    if old.nbytes != new.nbytes:
        return wire.Refused(code="bad_request", message=f"delta of {what}: the chunks differ in size "
                            f"({old.nbytes} and {new.nbytes} bytes)"), b""
    payload = delta.encode(old, new)
    if payload is None:
        return wire.DeltaBytes(nbytes=new.nbytes, full=True), new.numpy().tobytes()
    return wire.DeltaBytes(nbytes=len(payload), full=False), payload


def whole(held: Optional[Replica], index: int):
    """The chunk at ``index`` of ``held``'s memory when it holds that chunk whole and
    verified (a publisher: every chunk of its shard), else None."""
    if held is None or held.dropped or not 0 <= index < len(held.placed.views):
        return None
    if held.rank < 0:
        with held.lock:
            if index not in held.held:
                return None
    return held.placed.views[index]
