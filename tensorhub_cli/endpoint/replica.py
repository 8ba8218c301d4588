"""What an endpoint holds of one version: its layout in our memory and its chunks.

``handle`` is the engine's registration of ``placed.regions``, owned by ``reg`` (the
endpoint's ``registrations`` cache entry; a replica gives it back when dropped, it is
not deregistered by the replica). ``written``: the event after the last scatter of a
fetch into it (``streams``), None while none happened.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..engines import wire
from ..hub import protocol as p
from ..layout import Placed


@dataclass
class Held:
    model: str
    version: int
    world: int
    shards: list[p.Manifest]  # a publisher's own shard only; a reader's: every shard
    rank: int  # >= 0: published shard; -1: a reader's replica
    placed: Placed
    handle: object  # the engine's registration (of ``reg``)
    held: set[int] = field(default_factory=set)  # global chunk ids verified (readers)
    # Chunks read in part and verified (a reader of another layout): in our memory,
    # not held, never served.
    passed: set[int] = field(default_factory=set)
    reading: dict[int, str] = field(default_factory=dict)  # chunk -> source, in flight
    description: bytes | None = None
    reg: object = None  # registrations.Registration
    written: object = None  # streams: the event recorded after the last scatter into our destination
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> tuple[str, int]:
        return self.model, self.version

    def holding(self) -> p.Holding:
        with self.lock:
            return p.Holding(model=self.model, version=self.version, world=self.world, shards=self.shards,
                             rank=self.rank, held=sorted(self.held),
                             reading=[p.Read(chunk=c, source=s) for c, s in sorted(self.reading.items())])

    def described(self, engine) -> wire.Described:
        if self.description is None:
            self.description = engine.describe(self.handle)
        return wire.Described(engine=engine.kind, description=self.description, rank=self.rank,
                              addrs=[0 if v is None else v.data_ptr() for v in self.placed.views],
                              device=self.placed.device)

    @property
    def wanted(self) -> int:
        """How many chunks this replica needs: all, or those its layout's boxes touch."""
        return len(self.placed.views) if self.placed.wanted is None else len(self.placed.wanted)

    @property
    def complete(self) -> bool:
        """A publisher's shard, or a reader that has every chunk it needs (held or passed)."""
        return self.rank >= 0 or len(self.held) + len(self.passed) >= self.wanted

    def want(self) -> bytes:
        """``Plan.want`` for the chunks still needed and not passed (b"": every chunk;
        a zero mask once only held ones are left, so the hub answers ``complete``)."""
        if self.placed.wanted is None:
            return b""
        mask = 0
        for c in self.placed.wanted - self.passed:
            mask |= 1 << c
        return mask.to_bytes(max(1, (mask.bit_length() + 7) // 8), "little")

    def starts(self) -> list[int]:
        """Global id of each shard's first chunk (a reader's view: rank 0's first)."""
        out, at = [], 0
        for m in self.shards:
            out.append(at)
            at += len(m.chunks)
        return out

    def expected(self, chunk: int) -> p.ChunkMeta:
        for m in self.shards:
            if chunk < len(m.chunks):
                return m.chunks[chunk]
            chunk -= len(m.chunks)
        raise IndexError(chunk)

    def overlaps(self, regions) -> bool:
        return any(a.device == b.device and a.addr < b.addr + b.nbytes and b.addr < a.addr + a.nbytes
                   for a in self.placed.regions for b in regions)
