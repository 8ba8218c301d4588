"""The registration cache: memory published or fetched into again is registered with the engine once.

Protocol. ``acquire(model, placed, owned, fill)`` returns the ``Registration`` a new
replica uses: an idle one over the same memory (nothing registered), else a fresh one
(``engine.register``). ``give_back(reg)`` when the replica is let go after an unpublish;
``drop(reg)`` when its memory goes back to the caller for good (``Endpoint.discard``:
the hub forgot the version); ``close()`` deregisters everything.

Same memory. Every region equal as (addr, nbytes, device), except the layout's own
staging buffers (``Placed.keep`` tensors that are none of ``owned``, the caller's
tensors, in memory none of them covers), matched by (nbytes, device) in the same
place: the replica takes the registered buffer instead of its new one (the bytes are
copied over when ``fill``: a publisher's small tensors; a reader's staging is empty),
and every view and scatter piece into it follows. So the trainer's in-place loop
(publish v, unpublish v, optimizer step, publish v+1) and a reader fetching each
version into the same tensors register nothing after the first version.

When an unused (idle) registration is deregistered, whichever comes first:

1. the next ``acquire`` for the same model that does not reuse it (a model's memory
   stays registered through one publish/fetch unused; memory a caller allocates
   afresh per version, as agents do, is let go at the next version);
2. idle registrations hold more than ``cap_bytes`` (the endpoint's ``reg_cache_bytes``,
   ``REG_CACHE_BYTES`` by default; the oldest go first; 0: every give_back deregisters);
3. an ``acquire`` over memory overlapping it that is not the same (a new registration
   never overlaps an idle one);
4. its memory changed under it, as seen at the next ``acquire``: a storage it
   registered was resized or moved. FSDP frees parameters by resizing their storage
   to 0 and regrows them later, often at the same address and size, where the old
   registration (pinned pages, an IPC handle) would point at freed memory: so every
   storage a registration covers is *watched* (``_watch``: its ``resize_`` marks the
   registrations over it), and one resized even once is never reused;
5. ``drop`` or ``close``.

Safety. While registered, a registration holds every storage it covers (and its
staging tensors), so that memory is never freed and handed to another tensor under a
stale registration; a lookup is by address *and* size, so a tensor of another size at
a registered address is never served by the old registration. No read is routed to
an idle registration: the hub routes reads to replicas only, our peer server serves
only replicas' ranges (``engines.serve``), and unpublish drained every read first. A
NIXL reader still holding an old description could read it (never write it); the
caller may overwrite that memory, and such a read fails its checksum.

Thread-safe: one lock around the table and the engine's register/deregister calls.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from ..engines.base import Engine, Region
from ..errors import BadArgument

log = logging.getLogger("tensorhub.endpoint")

REG_CACHE_BYTES = 256 << 30  # above one GPU's memory: a rank's in-place shard always stays registered


@dataclass(eq=False)
class Registration:
    regions: tuple[Region, ...]
    handle: object  # the engine's
    shape: tuple  # what memory it is: ``_shape``
    staged: list  # our staging tensors, in the order of ``shape``'s
    held: list  # (storage, data_ptr, nbytes) of every storage the regions lie in
    model: str
    users: int = 0
    resized: bool = False  # a storage it covers was resized since it was registered (``_watch``)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(r.nbytes for r in self.regions)
        for storage, _, _ in self.held:
            _watch(storage, self)

    def intact(self) -> bool:
        """No storage it covers was resized (even back to where and how big it was)."""
        return not self.resized and all(_storage_at(s) == (ptr, n) for s, ptr, n in self.held)

    def overlaps(self, regions) -> bool:
        return any(a.device == b.device and a.addr < b.addr + b.nbytes and b.addr < a.addr + a.nbytes
                   for a in self.regions for b in regions)


_WATCHERS = "_tensorhub_registrations"  # a storage's attribute: the registrations over it


def _watch(storage, reg: "Registration") -> None:
    """Mark ``reg`` resized whenever ``storage.resize_`` runs. torch keeps one Python
    object per storage, and FSDP (1 and 2) frees and regrows parameters through that
    object's ``resize_``; a shadowing instance attribute sees every such call. A
    resize from C++ alone would pass unseen, but then address or size differ unless
    the allocator handed the same block back."""
    attrs = getattr(storage, "__dict__", None)
    if attrs is None:  # (no Python object to watch: ``_Pinned``, a tensor subclass)
        return
    regs = attrs.get(_WATCHERS)
    if regs is None:
        regs = attrs[_WATCHERS] = weakref.WeakSet()
        resize, ref = type(storage).resize_, weakref.ref(storage)  # (no cycle through the storage)

        def resize_(nbytes):
            for r in list(regs):
                r.resized = True
            return resize(ref(), nbytes)

        attrs["resize_"] = resize_
    regs.add(reg)


def _storage_at(storage) -> tuple[int, int]:
    return storage.data_ptr(), storage.nbytes()


def _holds(tensors) -> list:
    """What keeps each tensor's memory allocated: its storage (a parameter whose
    ``.data`` is replaced later keeps the old one alive here), else the tensor."""
    out = []
    for t in tensors:
        try:
            s = t.untyped_storage()
            out.append((s, *_storage_at(s)))
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):  # (a tensor subclass without one)
            out.append((_Pinned(t), 0, 0))
    return out


class _Pinned:
    def __init__(self, t):
        self.t = t

    def data_ptr(self) -> int:
        return 0

    def nbytes(self) -> int:
        return 0


def _staging(placed, owned) -> dict[int, object]:
    """Region index -> the layout's own buffer there (none of the caller's tensors, in
    memory none of them covers). None of ``owned`` known: no region is ours."""
    if owned is None:
        return {}
    spans = []
    for t in owned:
        try:
            spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            return {}  # memory we cannot locate: take nothing for ours
    mine = {}
    for t in placed.keep:
        if any(t is o for o in owned):
            continue
        lo = t.data_ptr()
        if any(a < lo + t.nbytes and lo < b for a, b in spans):
            continue
        for i, r in enumerate(placed.regions):
            if r.addr == lo and r.nbytes == t.nbytes and i not in mine:
                mine[i] = t
                break
    return mine


def _shape(placed, staging: dict) -> tuple[tuple, list[int]]:
    """What makes two replicas' memory the same, whatever the order of their regions:
    the caller's regions as (addr, nbytes, device), the staging buffers' (nbytes,
    device); and the staging region indexes in that order."""
    regions = placed.regions
    public = tuple(sorted((r.addr, r.nbytes, r.device) for i, r in enumerate(regions) if i not in staging))
    order = sorted(staging, key=lambda i: (regions[i].nbytes, regions[i].device, i))
    return (public, tuple((regions[i].nbytes, regions[i].device) for i in order)), order


def cap_bytes(value: object) -> int:
    """``reg_cache_bytes`` as given, or ``BadArgument`` naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadArgument(f"reg_cache_bytes takes an int >= 0 (bytes), not {value!r}")
    return value


class Registrations:
    def __init__(self, engine: Engine, cap: int = REG_CACHE_BYTES):
        self.engine = engine
        self.cap_bytes = cap_bytes(cap)
        self._lock = threading.Lock()
        self._used: dict[int, Registration] = {}  # by id: in use by at least one replica
        self._idle: OrderedDict[int, Registration] = OrderedDict()  # oldest first

    def acquire(self, model: str, placed, owned=None, *, fill: bool = False) -> Registration:
        """The registration of ``placed.regions`` for a replica of ``model``; ``placed``
        may be moved onto a cached staging buffer (see the module). ``owned``: the
        caller's tensors (None: every region is theirs)."""
        staging = _staging(placed, owned)
        shape, order = _shape(placed, staging)
        with self._lock:
            for reg in [r for r in self._idle.values() if not r.intact()]:
                self._deregister(reg, "its memory was resized or moved")
            reg = next((r for r in reversed(self._idle.values()) if r.shape == shape), None)
            if reg is not None:
                del self._idle[id(reg)]
                self._adopt(reg, placed, [(i, staging[i]) for i in order], fill)
            for old in [r for r in self._idle.values() if r.model == model or r.overlaps(placed.regions)]:
                self._deregister(old, "not reused by the next version" if old.model == model else "memory reused")
            if reg is None:
                reg = Registration(regions=tuple(placed.regions), handle=self.engine.register(placed.regions),
                                   shape=shape, staged=[staging[i] for i in order], held=_holds(placed.keep),
                                   model=model)
            reg.model, reg.users = model, reg.users + 1
            self._used[id(reg)] = reg
            return reg

    def _adopt(self, reg: Registration, placed, staging: list, fill: bool) -> None:
        """Move ``placed`` off its new staging buffers ((region index, tensor), in the
        order of ``reg.staged``) onto ``reg``'s."""
        for (i, new), ours in zip(staging, reg.staged):
            if fill:
                ours.copy_(new)
            placed.follow(new, ours)
            placed.regions[i] = Region(ours.data_ptr(), ours.nbytes, placed.regions[i].device)

    def give_back(self, reg: Registration | None) -> None:
        """One replica less uses ``reg``; unused, it stays registered (the module's rules)."""
        self._let_go(reg, keep=True)

    def drop(self, reg: Registration | None) -> None:
        """One replica less uses ``reg``; unused, it is deregistered now."""
        self._let_go(reg, keep=False)

    def _let_go(self, reg: Registration | None, *, keep: bool) -> None:
        if reg is None:
            return
        with self._lock:
            if self._used.get(id(reg)) is not reg:  # let go already (a close came first)
                return
            reg.users -= 1
            if reg.users:
                return
            del self._used[id(reg)]
            if not keep:
                self._deregister(reg, "dropped")
                return
            self._idle[id(reg)] = reg
            idle = sum(r.nbytes for r in self._idle.values())
            while idle > self.cap_bytes and self._idle:
                oldest = next(iter(self._idle.values()))
                idle -= oldest.nbytes
                self._deregister(oldest, f"idle registrations above reg_cache_bytes={self.cap_bytes}")

    def _deregister(self, reg: Registration, why: str) -> None:
        self._idle.pop(id(reg), None)
        log.debug("deregistering %d bytes of %s: %s", reg.nbytes, reg.model, why)
        self.engine.deregister(reg.handle)
        reg.held, reg.staged = [], []

    def idle(self) -> list[Registration]:
        with self._lock:
            return list(self._idle.values())

    def close(self, keep=()) -> None:
        """Deregister every registration, used ones too (the endpoint is leaving),
        except those in ``keep``: memory a read may still write stays registered and
        allocated (a leak, rather than memory freed under a transfer)."""
        keep = {id(reg) for reg in keep}
        with self._lock:
            for reg in list(self._idle.values()) + list(self._used.values()):
                if id(reg) in keep:
                    log.warning("leaving %d bytes of %s registered: a read may still write them", reg.nbytes,
                                reg.model)
                    continue
                self._deregister(reg, "closing")
            self._used = {}
