"""The reader side of a delta read: chunk c of v+1 asked of a holder as a delta against
our own verified chunk c of a base version (``engines.wire.ReadDelta``), rebuilt into
the chunk's memory.

Protocol. ``DeltaReads`` has the engine verbs a fetch's records use (``state``,
``release``, ``when_over``; ``engines.base.Engine``), so a delta read is one more
``Reading`` in flight: it is pinned, timed out, stopped and reported like any read.
``start`` runs one read on the pool: the ask, the rebuild (``delta.rebuild``: the
delta names the XXH3 of the base it was made against and of its result, so a delta
made against other bytes is refused, never applied), and the copy into the chunk's
memory. The copy happens under the lock ``release`` takes, and only while the read is
not released: once ``release`` returned, nothing writes to that memory (the caller may
re-read the chunk there). A read that ends "done" is *landed*, not verified: the fetch
checksums it against v+1's digest as it does every chunk (contract 5). One that ends
"failed" says why in ``error``; the fetch then reads that chunk in full.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from .. import delta
from ..engines import wire


@dataclass(eq=False)
class DeltaRead:
    """One delta read: the engine's "transfer"."""

    chunk: int
    state: str = "pending"  # "pending", then "done" or "failed"
    released: bool = False
    full: bool = False  # the holder sent the chunk itself
    wire_bytes: int = 0  # what crossed the link
    error: str = ""
    fns: list = field(default_factory=list)


@dataclass(frozen=True)
class DeltaAsk:
    """Where to ask: the holder's peer address and the ask's fields."""

    address: str
    token: str
    model: str
    version: int
    base: int
    index: int  # in the holder's ``Described.addrs``
    timeout: float
    source: Optional[str] = None  # our address to send from


class DeltaReads:
    kind = "delta"

    def __init__(self, pool: Executor):
        self._pool = pool
        self._lock = threading.Lock()

    def start(self, ask: DeltaAsk, old: torch.Tensor, into: torch.Tensor) -> DeltaRead:
        """Read ``ask``'s chunk as a delta against ``old`` (our base chunk, held and
        verified) into ``into`` (its flat uint8 memory). Leave ``into`` alone until the
        read is over or ``release`` returned True."""
        x = DeltaRead(chunk=ask.index)
        self._pool.submit(self._run, x, ask, old, into)
        return x

    def state(self, x: DeltaRead) -> str:
        return x.state

    def release(self, x: DeltaRead) -> bool:
        with self._lock:
            x.released = True
            return x.state != "pending"

    def when_over(self, x: DeltaRead, fn: Callable[[str], None]) -> None:
        with self._lock:
            if x.state == "pending":
                x.fns.append(fn)
                return
        fn(x.state)

    def close(self) -> None:
        """No new reads; those running finish on their own (released ones copy nothing)."""
        self._pool.shutdown(wait=False, cancel_futures=False)

    def _run(self, x: DeltaRead, ask: DeltaAsk, old: torch.Tensor, into: torch.Tensor) -> None:
        new = None
        try:
            payload, x.full = wire.read_delta(ask.address, ask.token, ask.model, ask.version, ask.base, ask.index,
                                              into.nbytes, ask.timeout, source=ask.source)
            x.wire_bytes = len(payload)
            if x.full:
                new = np.frombuffer(payload, dtype=np.uint8)
            else:
                new = delta.rebuild(old if old.device.type == "cpu" else old.cpu(), payload)
        except (wire.PeerError, delta.DeltaError) as exc:
            x.error = str(exc)
        except Exception as exc:  # a bug must fail the read (then read in full), not hang the fetch
            x.error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if new is not None and not x.released:
                into.copy_(torch.from_numpy(new))
            x.state = "done" if new is not None else "failed"
            fns, x.fns = x.fns, []
        for fn in fns:
            fn(x.state)
