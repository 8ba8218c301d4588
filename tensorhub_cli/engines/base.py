"""The one interface every byte mover implements: register, describe, read, check.

Protocol. A holder ``register``s the memory it will serve and hands ``describe(reg)``
to readers (over our authenticated peer channel, never an engine's own listener). A
reader ``add_peer``s that description once per holder and version, then ``read``s a
list of (remote address → local address, nbytes) pairs; ``state`` says whether that
read is pending, done or failed, and ``release`` frees it once it is not pending (or
gives up on it; see ``release``). Instead of asking ``state`` again and again, a reader
blocks on ``when_over(transfer, fn)``: ``fn(state)`` is called exactly once when the read
is no longer pending, from whichever thread sees it end (tcp: the read's own thread;
engines without a completion callback, nixl: the engine's watcher thread,
``engines.watcher``, the one poll left); the reader still ``release``s it afterwards,
and ``close`` stops the watcher. Reads are one-sided: the holder's code does nothing
per read beyond calling ``progress`` regularly, which some transports need.

Memory handed to ``register`` must stay allocated and unmoved until ``deregister``;
once ``deregister`` returns, the caller may free or overwrite it. The holder side of
the tcp engine's reads (``ReadBytes`` on the peer channel) is ``engines.serve``: every
endpoint serves it whatever its own engine, so a tcp reader can read any holder.

Devices. A ``Region`` names its device (-1: host; N: CUDA device N), a holder's
``describe`` carries the device of what it registered, and every ``read`` names both
sides: the local ``device`` it writes into and the holder's ``remote_device`` (None:
the one its description gave). Transports that move host bytes only (tcp) reach device
memory through ``DeviceCopy``: a pinned host staging buffer and one synchronous copy to
or from the device per piece, so the device memory is touched only by that copy.
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from typing import Callable, Literal, NamedTuple

State = Literal["pending", "done", "failed"]


class Region(NamedTuple):
    addr: int
    nbytes: int
    device: int = -1  # -1: host memory; >= 0: that CUDA device


def host_view(addr: int, nbytes: int) -> memoryview:
    """A writable view of host memory at ``addr`` (registered memory only: the view
    does not keep it alive)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


class DeviceCopy:
    """The copy boundary between device memory and host staging, for host-only
    transports. Every method returns once its bytes are where they were sent (the copy
    is synchronous), so a read counted done has its bytes on the device. Addresses are
    raw: the caller keeps what they point into alive. Tests inject a fake; the default
    (``TorchDeviceCopy``) uses torch on CUDA."""

    def staging(self, nbytes: int) -> tuple[int, object]:
        """A host buffer of ``nbytes`` (pinned where it can be): its address, and the
        object that keeps it allocated (the caller holds it while it uses the address)."""
        raise NotImplementedError

    def to_device(self, host: int, addr: int, nbytes: int, device: int) -> None:
        """Copy ``nbytes`` from host memory at ``host`` to ``addr`` on CUDA ``device``."""
        raise NotImplementedError

    def from_device(self, addr: int, device: int, host: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``addr`` on CUDA ``device`` to host memory at ``host``."""
        raise NotImplementedError


class _CudaBytes:
    """Raw CUDA memory as ``__cuda_array_interface__``, which ``torch.as_tensor`` wraps
    without a copy (version 2: no stream key, so torch waits on none)."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 2}


class TorchDeviceCopy(DeviceCopy):
    """``DeviceCopy`` with torch: staging from its caching pinned-host allocator (so a
    buffer per read costs no cudaHostAlloc after the first), blocking ``copy_`` on the
    device's current stream."""

    def staging(self, nbytes: int) -> tuple[int, object]:
        import torch

        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return buf.data_ptr(), buf

    @staticmethod
    def _pair(host: int, addr: int, nbytes: int, device: int):
        import torch

        cpu = torch.frombuffer(host_view(host, nbytes), dtype=torch.uint8)
        # No device= here: given one that differs from the pointer's, torch would copy
        # and we would write into the copy. The pointer's own device must be the named one.
        dev = torch.as_tensor(_CudaBytes(addr, nbytes))
        if dev.device != torch.device("cuda", device):
            raise EngineError(f"memory at {addr:#x} is on {dev.device}, not cuda:{device} as its region says")
        return cpu, dev

    def to_device(self, host: int, addr: int, nbytes: int, device: int) -> None:
        import torch

        with torch.cuda.device(device):
            cpu, dev = self._pair(host, addr, nbytes, device)
            dev.copy_(cpu)
            torch.cuda.current_stream(device).synchronize()

    def from_device(self, addr: int, device: int, host: int, nbytes: int) -> None:
        import torch

        with torch.cuda.device(device):
            cpu, dev = self._pair(host, addr, nbytes, device)
            cpu.copy_(dev)
            torch.cuda.current_stream(device).synchronize()


class Pair(NamedTuple):
    remote: int  # address in the holder's registered memory
    local: int  # address in ours
    nbytes: int


class EngineError(Exception):
    pass


_WATCHER = threading.Lock()  # (creates an engine's watcher once: engines have no __init__ of ours)


class Engine(ABC):
    """Per method: what the caller may do once it returns."""

    kind: str
    needs_progress: bool = False  # True: reads of our memory stall unless ``progress`` runs
    # The watcher's back-off ceiling (``engines.watcher``): how late it may notice a
    # transfer's end. An engine whose checks only notice (they move no bytes) may raise it.
    watch_ceiling_s: float = 1e-3

    @abstractmethod
    def register(self, regions: list[Region]) -> object:
        """Make ``regions`` readable by peers and writable by our reads; returns a handle.
        The caller may ``describe`` it and read into the regions; it must keep the
        memory allocated and unmoved until ``deregister``."""

    @abstractmethod
    def describe(self, handle: object) -> bytes:
        """What a remote reader needs, besides addresses, to read the handle's regions.
        The caller may hand it to any authenticated reader, any number of times."""

    @abstractmethod
    def deregister(self, handle: object) -> None:
        """After this returns no peer can read the regions and the caller owns them again."""

    @abstractmethod
    def add_peer(self, address: str, description: bytes) -> object:
        """Load a holder's description (idempotent); returns the peer key ``read`` takes.
        Raises EngineError when the description cannot be loaded."""

    @abstractmethod
    def read(self, peer: object, pairs: list[Pair], device: int = -1, remote_device: int | None = None) -> object:
        """Start one read of all ``pairs`` into local memory on ``device`` (-1: host)
        from the holder's memory on ``remote_device`` (None: the device the holder's
        description named; given, it must agree with it);
        returns a transfer to poll. Raises EngineError
        when the read cannot even start (unknown peer, unregistered memory). The caller
        must leave the target memory alone and poll ``state`` until it is not pending,
        then ``release`` it."""

    @abstractmethod
    def state(self, transfer: object) -> State:
        """``done``: every target byte arrived (unverified); ``failed``: the target's
        bytes are undefined; ``pending``: poll again. Never blocks."""

    @abstractmethod
    def release(self, transfer: object) -> bool:
        """Free a transfer; a pending one is told to stop. Returns False while it may
        still touch either buffer (in flight, or stopping but not confirmed): the caller
        keeps it, counts it as in flight (its source's pin stays, contract 3) and tries
        again later. True: it is over, and the target memory is the caller's again."""

    def when_over(self, transfer: object, fn: Callable[[State], None]) -> None:
        """Call ``fn(state)`` exactly once, with "done" or "failed", when ``transfer`` is
        no longer pending: at once on this thread when it already is, else from
        whichever thread sees it end. The caller still ``release``s it afterwards (a
        transfer ``release``d before its callback came is reported "failed" by engines
        that cannot tell). ``fn`` must be quick; what it raises is logged.
        Default: the engine's watcher thread checks ``states_of`` (``engines.watcher``)
        and raises EngineError once ``close`` stopped it; engines with a completion of
        their own (tcp) override it."""
        self._watcher().watch(transfer, fn, self.size_of(transfer))

    def size_of(self, transfer: object) -> int:
        """Bytes ``transfer`` moves, or 0 when the engine does not keep it (the watcher
        then predicts its end from durations alone)."""
        return 0

    def states_of(self, transfers: list) -> list[State]:
        """``state`` of each transfer: the watcher's one call per round (an engine may
        answer them under one lock)."""
        return [self.state(t) for t in transfers]

    def _watcher(self):
        from .watcher import Watcher  # (it imports this module)

        with _WATCHER:
            watcher = self.__dict__.get("_watch")
            if watcher is None:
                watcher = self.__dict__["_watch"] = Watcher(self.states_of, name=f"th-watch-{self.kind}",
                                                            max_s=self.watch_ceiling_s,
                                                            serve=self.progress if self.needs_progress else None)
        return watcher

    def _stop_watching(self, timeout: float = 5.0) -> None:
        """Stop the watcher thread, if ``when_over`` or ``pace`` ever started one (every
        ``close``). A watcher never made is made closed, so a late ``pace`` starts none."""
        self._watcher().close(timeout)

    def pace(self, every_s: float | None) -> None:
        """Serve peers' reads of our memory: ``progress`` at least every ``every_s`` from
        the engine's watcher thread, whose checks of our own reads ride on the same wakes
        (``engines.watcher``); None: nothing of ours is being read, stop. Once it returns
        the caller need not call ``progress`` itself. Engines that do not
        ``needs_progress`` ignore it; after ``close`` it does nothing."""
        if self.needs_progress:
            self._watcher().pace(every_s)

    def progress(self) -> None:
        """Let the transport serve peers' reads of our memory; the watcher calls it at
        the pace the endpoint sets (``pace``). Never blocks."""

    def close(self) -> None:
        """Stop the engine (and its watcher thread); the caller makes no further call on it."""
        self._stop_watching()
