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

from collections.abc import Mapping
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


class Sending(Mapping):
    """Source -> the chunks it is sending to readers that will hold them whole, which a
    windowed plan had better have relayed than sent again (``planner.Sources.sending``).
    A view of ``Version.fed``, worked out per source when asked: a schedule never asks,
    and its pins and unpins stay a few bitset operations."""

    __slots__ = ("fed",)

    def __init__(self, fed: dict[str, dict[str, int]]):
        self.fed = fed

    def __getitem__(self, source: str) -> int:
        out = 0
        for chunks in self.fed[source].values():
            out |= chunks
        return out

    def __contains__(self, source: object) -> bool:
        return source in self.fed

    def __iter__(self):
        return iter(self.fed)

    def __len__(self) -> int:
        return len(self.fed)


@dataclass
class Replica:
    endpoint: str
    held: int = 0
    rank: int = -1  # >= 0: published shard (a publisher); -1: filled by reading
    # A reader whose plan was answered complete: it has every chunk its boxes need
    # (a reader of another layout holds them in part, so ``held`` never becomes full).
    satisfied: bool = False
    # Rebuilt from a re-registration (``publishing.restore``): a reader that has not
    # re-registered yet may still be reading it, so its drain waits out the restart's
    # grace period. A replica the hub saw begin has no reads it does not know of.
    restored: bool = False
    # Chunks the reader's last beat said it had verified (``Heartbeat.filling``): shown
    # to operators while its fetch runs, never planned from (its reports make ``held``).
    told: int = 0


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
    # Reads in flight, a source at a time (a reader reads from a few sources, a schedule
    # many chunks from each): reader -> {source: chunks}; pins: source -> reads.
    feeds: dict[str, dict[str, int]] = field(default_factory=dict)
    pins: dict[str, int] = field(default_factory=dict)
    # The same reads the other way round, those whose reader will hold the chunk whole
    # (it may relay it): source -> {reader: chunks} (``sending``: their union per source).
    fed: dict[str, dict[str, int]] = field(default_factory=dict)
    quiet: dict[str, int] = field(default_factory=dict)  # reader -> chunks it reads as tiles (not in ``fed``)
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
    mustered: set[tuple[str, int]] = field(default_factory=set)  # swarms (dc, want) whose muster closed
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

    @property
    def sending(self) -> Sending:
        return Sending(self.fed)

    def reading(self, reader: str) -> int:
        """The chunks ``reader`` has reads of in flight."""
        out = 0
        for chunks in self.feeds.get(reader, {}).values():
            out |= chunks
        return out

    def source_of(self, reader: str, chunk: int) -> str | None:
        for source, chunks in self.feeds.get(reader, {}).items():
            if chunks >> chunk & 1:
                return source
        return None

    def pin(self, reader: str, source: str, chunks: int, relays: bool = True) -> None:
        """Reads of ``chunks`` (a bitset, none of them in flight for ``reader``) from
        ``source``. ``relays``: the reader will hold them whole, so others may wait for
        it to relay them (``sending``); a reader of another layout reads tiles only."""
        if not chunks:
            return
        feeds = self.feeds.setdefault(reader, {})
        feeds[source] = feeds.get(source, 0) | chunks
        self.pins[source] = self.pins.get(source, 0) + chunks.bit_count()
        if not relays:
            self.quiet[reader] = self.quiet.get(reader, 0) | chunks
            return
        fed = self.fed.setdefault(source, {})
        fed[reader] = fed.get(reader, 0) | chunks

    def unpin(self, reader: str, chunks: int) -> dict[str, int]:
        """Ends ``reader``'s reads of ``chunks`` (a bitset; -1: all; chunks not in
        flight are skipped); returns how many ended per source."""
        feeds = self.feeds.get(reader)
        if not feeds:
            return {}
        ended: dict[str, int] = {}
        for source, mine in list(feeds.items()):
            gone = mine & chunks
            if not gone:
                continue
            ended[source] = n = gone.bit_count()
            if mine & ~gone:
                feeds[source] = mine & ~gone
            else:
                del feeds[source]
            left = self.pins[source] - n
            if left:
                self.pins[source] = left
            else:
                del self.pins[source]
            quiet = self.quiet.get(reader, 0) & gone
            if quiet:
                rest = self.quiet[reader] & ~quiet
                if rest:
                    self.quiet[reader] = rest
                else:
                    del self.quiet[reader]
            relayed = gone & ~quiet
            if relayed:
                fed = self.fed[source]
                if fed[reader] & ~relayed:
                    fed[reader] &= ~relayed
                else:
                    del fed[reader]
                    if not fed:
                        del self.fed[source]
        if not feeds:
            del self.feeds[reader]
        return ended

    def bytes_of(self, chunks: int) -> int:
        return sum(n * (chunks & mask).bit_count() for n, mask in self.size_masks.items())


    def status(self, reliable=lambda name: False) -> p.VersionStatus:
        holders = [
            p.HolderStatus(name=name, held_bytes=self.bytes_of(r.held | r.told), complete=self.complete(name),
                           reliable=reliable(name), draining=name in self.draining)
            for name, r in sorted(self.replicas.items())
        ]
        return p.VersionStatus(
            model=self.model, version=self.number, state=self.state, chunks=self.nchunks, nbytes=self.nbytes,
            replicas=len(self.replicas), complete_replicas=sum(h.complete for h in holders),
            reliable_copies=sum(h.complete and h.reliable for h in holders), holders=holders,
        )
