"""What an endpoint holds of one version: its layout in our memory and its chunks (the
endpoint's record of its replica; the hub keeps its own, ``hub.registry.Replica``).

``handle`` is the engine's registration of ``placed.regions``, owned by ``reg`` (the
endpoint's ``registrations`` cache entry; a replica gives it back when dropped, it is
not deregistered by the replica). ``written``: the event after the last scatter of a
fetch into it (``streams``), None while none happened.

Holder notices (the peer channel's ``Await``, ``engines.wire``). A reader counts a
verified chunk held with ``mark_held``, never by adding to ``held`` directly: it wakes
every wait for that chunk (``await_held``: an asyncio future the peer server's loop
awaits, resolved on that loop with ``call_soon_threadsafe``). Nothing polls. A reader
reading a chunk in fragments (``endpoint.reader``) counts each fragment with
``mark_landed`` (bytes from the chunk's first, unverified), which wakes the waits that
asked for fragments (``after``) with a chunk of theirs further along than they knew. ``gone``
(``Replicas.drop``) resolves every wait with None and refuses new ones, so no
wait outlives the replica. A publisher holds its whole shard from the start; it knows
only its own manifest, not where its shard starts among the version's global chunk ids,
so with ``world > 1`` it answers every asked chunk (the hub names it only for chunks of
its shard).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ..engines import wire
from ..hub import protocol as p
from ..layout import Placed


@dataclass
class Replica:
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
    # While a scheduled fetch fills this replica: wakes it to ask the hub for a new plan
    # (the hub dropped a source of its reads). Called from the service thread; quick.
    replan: Optional[Callable[[], None]] = None
    written: object = None  # streams: the event recorded after the last scatter into our destination
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Waits for chunks (``await_held``): (loop, future, mask, after), under ``lock``.
    waiters: list = field(default_factory=list)
    landed: dict[int, int] = field(default_factory=dict)  # chunk -> bytes landed, not verified (fragments)
    dropped: bool = False  # ``gone`` was called: every wait is refused
    _digest: Optional[int] = None

    @property
    def digest(self) -> int:
        """The version's ``manifest_digest`` (a reader's replica: as the hub computes it)."""
        if self._digest is None:
            self._digest = p.manifest_digest(self.world, self.shards)
        return self._digest

    @property
    def key(self) -> tuple[str, int]:
        return self.model, self.version

    def holding(self) -> p.Holding:
        with self.lock:
            return p.Holding(model=self.model, version=self.version, world=self.world, shards=self.shards,
                             rank=self.rank, held=sorted(self.held),
                             reading=[p.Read(chunk=c, source=s) for c, s in sorted(self.reading.items())],
                             tiled=sorted(self.passed), layout=self.placed.layout if self.passed else "")

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
        return p.bitset(mask)

    def chunk_count(self) -> Optional[int]:
        """How many global chunk ids the version has, when this replica can tell (a
        publisher of one shard of several cannot: None)."""
        if self.rank >= 0 and self.world > 1:
            return None
        return sum(len(m.chunks) for m in self.shards)

    def filling(self) -> Optional[p.Filling]:
        """Our progress for a beat (``Heartbeat.filling``) while a fetch fills this
        replica: None for a publisher's shard, a complete replica, or nothing verified yet."""
        if self.rank >= 0 or self.complete:
            return None
        with self.lock:
            mask = p.mask_of(self.held)
        return p.Filling(model=self.model, version=self.version, held=p.bitset(mask)) if mask else None

    def mark_held(self, chunks: Iterable[int]) -> None:
        """Count ``chunks`` (global ids, verified) held, and answer every wait that asked
        for one of them with the asked chunks held now. Callable from any thread."""
        added = 0
        with self.lock:
            for c in chunks:
                self.held.add(c)
                self.landed.pop(c, None)
                added |= 1 << c
            answers = self._woken(lambda mask, after: mask & added)
        _notify_all(answers)

    def mark_landed(self, chunk: int, nbytes: int) -> None:
        """``nbytes`` of ``chunk`` from its first byte are in our memory, not verified (0:
        none any more, its read starts over). Wakes the waits for fragments of it that knew
        less. Callable from any thread."""
        with self.lock:
            if chunk in self.held:
                return
            if nbytes <= 0:
                self.landed.pop(chunk, None)
                return
            self.landed[chunk] = nbytes
            answers = self._woken(lambda mask, after: after is not None and mask >> chunk & 1
                                  and nbytes > after.get(chunk, 0))
        _notify_all(answers)

    def _woken(self, ends) -> list:
        """(Under ``lock``.) Forget the waits ``ends(mask, after)`` is true for; their answers."""
        woken = [w for w in self.waiters if ends(w[2], w[3])]
        if woken:
            self.waiters = [w for w in self.waiters if not ends(w[2], w[3])]
        return [(loop, fut, self._answer(mask, after)) for loop, fut, mask, after in woken]

    def await_held(self, mask: int, loop: asyncio.AbstractEventLoop,
                   after: Optional[dict[int, int]] = None) -> asyncio.Future:
        """A future of ``loop`` (call this on the loop's thread) resolved with the chunks
        of ``mask`` held: at once when some are, else when ``mark_held`` adds one; with
        None once the replica is ``gone``. With ``after`` (chunk -> landed bytes known),
        also once one of those chunks has more landed, and resolved with (chunks held,
        {chunk of ``mask`` not held: bytes landed}). Give it back with ``forget`` when
        giving up."""
        fut = loop.create_future()
        with self.lock:
            if self.dropped:
                fut.set_result(None)
            elif self._holds(mask) or after is not None and any(
                    n > after.get(c, 0) for c, n in self.landed.items() if mask >> c & 1):
                fut.set_result(self._answer(mask, after))
            else:
                self.waiters.append((loop, fut, mask, after))
        return fut

    def _answer(self, mask: int, after: Optional[dict[int, int]]):
        have = self._holds(mask)
        if after is None:
            return have
        return have, {c: n for c, n in self.landed.items() if mask >> c & 1 and not have >> c & 1}

    def forget(self, fut: asyncio.Future) -> None:
        with self.lock:
            self.waiters = [w for w in self.waiters if w[1] is not fut]

    def gone(self) -> None:
        """The replica is dropped: every wait is answered None, and every later one."""
        with self.lock:
            self.dropped = True
            waiters, self.waiters = self.waiters, []
        for loop, fut, *_ in waiters:
            _notify(loop, fut, None)

    def _holds(self, mask: int) -> int:
        """(Under ``lock``.) The chunks of ``mask`` held (see the module on publishers)."""
        if self.rank >= 0:
            n = self.chunk_count()
            return mask if n is None else mask & ((1 << n) - 1)
        if mask.bit_count() < len(self.held):
            return sum(1 << c for c in _bits(mask) if c in self.held)
        return sum(1 << c for c in self.held if mask >> c & 1)

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


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _notify_all(answers: list) -> None:
    for loop, fut, value in answers:
        _notify(loop, fut, value)


def _notify(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value) -> None:
    def answer() -> None:
        if not fut.done():  # (the wait may have timed out meanwhile)
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(answer)
    except RuntimeError:  # the loop is closed: its peer server ended, and the wait with it
        pass
