"""What the hub knows about one version: its manifest and its replicas. Pure data.

A version is published shard by shard (``rank`` of ``world``); once every rank's
manifest is in, it is *assembled*: its chunks get global ids, rank 0's first, and a
publisher holds exactly its shard's id range. Which chunks a replica holds is a Python
int used as a bitset (bit i = chunk i), so coverage and "what does the reader lack"
are single integer operations even for thousands of chunks.

State (contract 1): STAGING until assembled and covered by live holders; READY once
covered; UNAVAILABLE when a once-READY version loses its last holder of some chunk
(it is READY again when a holder returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from ..planner import HolderIndex
from ..planner.schedule import Swarms
from . import protocol as p

STAGING, READY, UNAVAILABLE = "STAGING", "READY", "UNAVAILABLE"


def bits(mask: int, start: int = 0):
    """Set bits of ``mask``, ascending from ``start`` and wrapping around to 0."""
    high = mask >> start
    while high:
        low = high & -high
        yield start + low.bit_length() - 1
        high ^= low
    rest = mask & ((1 << start) - 1)
    while rest:
        low = rest & -rest
        yield low.bit_length() - 1
        rest ^= low


@dataclass
class Replica:
    endpoint: str
    held: int = 0
    rank: int = -1  # >= 0: published shard (a publisher); -1: filled by reading
    # A reader whose plan was answered complete: it has every chunk its boxes need
    # (a reader of another layout holds them in part, so ``held`` never becomes full).
    satisfied: bool = False


@dataclass
class Version:
    model: str
    number: int
    world: int
    shards: dict[int, p.Manifest] = field(default_factory=dict)
    shard_digests: dict[int, int] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    publishers: set[str] = field(default_factory=set)  # the replicas with rank >= 0
    state: str = STAGING
    ever_ready: bool = False
    # derived at assembly
    offsets: list[int] = field(default_factory=list)
    nchunks: int = 0
    full: int = 0
    chunk_nbytes: list[int] = field(default_factory=list)
    digest: int = 0
    size_masks: dict[int, int] = field(default_factory=dict)  # chunk size -> chunks of that size
    # reads in flight: reader -> {chunk: source}; pins: source -> count
    reads: dict[str, dict[int, str]] = field(default_factory=dict)
    pins: dict[str, int] = field(default_factory=dict)
    serving: dict[str, dict[int, int]] = field(default_factory=dict)  # source -> {chunk: readers}
    # ``serving`` as bitsets (source -> chunks it is sending), kept with it by pin and
    # unpin so a plan reads a source's mask instead of building it per candidate.
    sending: dict[str, int] = field(default_factory=dict)
    quiet: set[tuple[str, int]] = field(default_factory=set)  # (reader, chunk) pins not in ``serving``
    seeds: dict[str, str] = field(default_factory=dict)  # dc -> the reader pulling across the DC link
    pulls: set[str] = field(default_factory=set)  # agents asked to pull a retention copy
    draining: set[str] = field(default_factory=set)  # replicas waiting for their pins to drain
    avoid: dict[str, set[str]] = field(default_factory=dict)  # reader -> sources that failed it
    # Replicas holding anything, by topology group (node, rack, DC), kept by the hub so a
    # plan walks the holders near its reader instead of every endpoint there.
    near: dict[tuple, set[str]] = field(default_factory=dict)
    # The same holders per DC by chunk, so a plan walks only those holding a chunk its
    # reader needs (``planner.HolderIndex``; kept with ``near``).
    holding: HolderIndex = field(default_factory=HolderIndex)
    # Per DC, the chunks its readers (not publishers) hold and may serve, and those two
    # or more of them hold (``planner.copies``): a publisher need not send these into
    # that DC again. Filled by the planner on demand; dropped whole when a reader loses
    # chunks (``respread``), grown in place when one gains.
    spread: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Holders per layout (contract 9): layout id -> reader -> the chunks it holds only
    # the tiles of, which serve readers of that layout alone (they need exactly those
    # tiles). Not holdings: never counted for coverage, retention or ``spread``.
    layouts: dict[str, dict[str, int]] = field(default_factory=dict)
    # Scheduled readers (``Plan.schedule``): their swarms and each DC's feeders
    # (``planner.schedule``; soft state: a restarted hub schedules afresh).
    swarms: Swarms = field(default_factory=Swarms)
    # ``manifests()`` encoded, as every ``Resolved`` reply carries them, cached by the
    # service (a large model's take milliseconds to encode). Valid while ``shards`` are:
    # they never change once assembled (an equal manifest may replace one; ``set_shard``
    # drops the cache all the same), and a version published again under its number
    # is another ``Version``.
    encoded: msgspec.Raw | None = None

    def set_shard(self, rank: int, manifest: p.Manifest, digest: int) -> None:
        self.shards[rank], self.shard_digests[rank] = manifest, digest
        self.encoded = None

    def respread(self, gained: int = -1, dc: str | None = None) -> None:
        """A reader in ``dc`` gained the chunks ``gained``, none of which it held
        before (cheap), or one lost chunks (-1)."""
        if gained < 0:
            self.spread.clear()
        elif dc in self.spread:
            once, twice = self.spread[dc]
            self.spread[dc] = (once | gained, twice | once & gained)

    @property
    def assembled(self) -> bool:
        return self.nchunks > 0

    @property
    def nbytes(self) -> int:
        return sum(self.chunk_nbytes)

    def assemble(self) -> None:
        if self.assembled or len(self.shards) < self.world:
            return
        offset, self.offsets = 0, []
        for rank in range(self.world):
            self.offsets.append(offset)
            offset += len(self.shards[rank].chunks)
        self.nchunks = offset
        self.full = (1 << offset) - 1
        self.chunk_nbytes = [c.nbytes for r in range(self.world) for c in self.shards[r].chunks]
        self.digest = p.manifest_digest(self.world, self.manifests())
        for i, n in enumerate(self.chunk_nbytes):
            self.size_masks[n] = self.size_masks.get(n, 0) | 1 << i
        for rep in self.replicas.values():
            if rep.rank >= 0:
                rep.held |= self.shard_mask(rep.rank)

    def manifests(self) -> list[p.Manifest]:
        return [self.shards[r] for r in range(self.world)]

    def shard_mask(self, rank: int) -> int:
        n = len(self.shards[rank].chunks)
        return ((1 << n) - 1) << self.offsets[rank]

    def coverage(self) -> int:
        out = 0
        for rep in self.replicas.values():
            out |= rep.held
            if out == self.full:
                break
        return out

    def missing(self) -> list[int]:
        return list(bits(self.full & ~self.coverage()))

    def refresh(self) -> str:
        if self.assembled and self.coverage() == self.full:
            self.state, self.ever_ready = READY, True
        else:
            self.state = UNAVAILABLE if self.ever_ready else STAGING
        return self.state

    def complete(self, name: str) -> bool:
        rep = self.replicas.get(name)
        return rep is not None and self.assembled and rep.held == self.full

    def loaded(self, name: str) -> bool:
        """``name`` has what it reads of this version: every chunk, or (a reader of
        another layout) every piece its boxes need. What a group round waits for;
        never a copy for retention (``complete``)."""
        rep = self.replicas.get(name)
        return self.complete(name) or (rep is not None and self.assembled and rep.satisfied)

    def pin(self, reader: str, chunk: int, source: str, relays: bool = True) -> None:
        """``relays``: the reader will hold the chunk whole, so others may wait for it
        to relay the chunk (``serving``); a reader of another layout reads tiles only."""
        self.reads.setdefault(reader, {})[chunk] = source
        self.pins[source] = self.pins.get(source, 0) + 1
        if not relays:
            self.quiet.add((reader, chunk))
            return
        chunks = self.serving.setdefault(source, {})
        n = chunks[chunk] = chunks.get(chunk, 0) + 1
        if n == 1:
            self.sending[source] = self.sending.get(source, 0) | 1 << chunk

    def unpin(self, reader: str, chunk: int) -> str | None:
        reads = self.reads.get(reader)
        if not reads or chunk not in reads:
            return None
        source = reads.pop(chunk)
        if not reads:
            del self.reads[reader]
        left = self.pins[source] - 1
        if left:
            self.pins[source] = left
        else:
            del self.pins[source]
        if (reader, chunk) in self.quiet:
            self.quiet.discard((reader, chunk))
            return source
        chunks = self.serving[source]
        if chunks[chunk] > 1:
            chunks[chunk] -= 1
        else:
            del chunks[chunk]
            if chunks:
                self.sending[source] &= ~(1 << chunk)
            else:
                del self.serving[source], self.sending[source]
        return source

    def held_bytes(self, held: int) -> int:
        return sum(n * (held & mask).bit_count() for n, mask in self.size_masks.items())

    def status(self, reliable=lambda name: False) -> p.VersionStatus:
        holders = [
            p.HolderStatus(name=name, held_bytes=self.held_bytes(r.held), complete=self.complete(name),
                           reliable=reliable(name), draining=name in self.draining)
            for name, r in sorted(self.replicas.items())
        ]
        return p.VersionStatus(
            model=self.model, version=self.number, state=self.state, chunks=self.nchunks, nbytes=self.nbytes,
            replicas=len(self.replicas), complete_replicas=sum(h.complete for h in holders),
            reliable_copies=sum(h.complete and h.reliable for h in holders), holders=holders,
        )
