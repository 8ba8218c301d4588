"""NIXL engine: one-sided UCX READs of registered host (DRAM) or CUDA (VRAM) memory.

Devices. A registration is host memory (DRAM) or memory of one CUDA device (VRAM,
that device's id): NIXL matches descriptors by (address, device id), so the holder's
``describe`` carries its device, the reader's ``add_peer`` keeps it in the peer key, and
every ``read`` gives NIXL both ids: the reader's ``device`` for the local side, the
holder's for the remote one (host memory is device id 0 on either side).

Defaults (the figures behind them: docs/design.md, "Measurements behind the defaults"):

- UCX environment (``nixl_shim``): ``UCX_MODULES=^ib`` only on hosts without an
  InfiniBand device (there UCX's IB module makes a process that created a backend die
  with SIGSEGV at exit); ``UCX_NET_DEVICES`` from the node's spec; a user's own
  ``UCX_*`` variables always win.
- Who progresses UCX: this engine's watcher thread calls ``progress`` at the pace the
  endpoint sets (``Engine.pace``: every millisecond while peers are reading us, every
  10 ms while we hold memory nobody asked about, not at all otherwise), and its checks
  of our own READs ride on the same wakes; NIXL's own UCX progress thread,
  event-driven, only with ``TH_NIXL_PROGRESS_THREAD=1`` (``nixl_progress``, which says
  why it is not the default: the wrapper's default makes it spin a full core, so we give
  it a 10 ms poll timeout and it sleeps on the worker's event descriptors).
- The passive side must progress: without it a holder never answers the rendezvous
  and a READ stays pending forever, over shared memory and TCP alike.
- Transports are left to UCX (between processes of one host it picks shared memory).
  ``UCX_TLS=cma,self`` or ``sm,self`` fail to create the backend ("no active messages
  transport"), so we never narrow UCX_TLS ourselves.
- Logging: the wrapper logs INFO lines to stdout; ``load_nixl`` moves them to stderr.
- Metadata: ``describe`` returns partial agent metadata (the handle's regions plus
  connection info) with the memory kind and device id. Loading it again for a known
  agent adds the new regions (checked), so one remote agent per holder serves every
  version it publishes. A description without a device id (an older holder) reads as
  device 0, which is what readers assumed before.
- UCX's TCP segments: the description also carries the holder's send segment
  (``nixl_shim.tcp_segments``), and ``add_peer`` refuses a holder whose send segment is
  larger than our receive segment, naming ``UCX_TCP_RX_SEG_SIZE``: UCX would write past
  our buffer (``nixl_shim``). A description without it (an older holder) sends UCX's
  default segments, which every receive segment UCX accepts can take. The device id and
  the segment travel as a map where older holders put a bare device id: an older reader,
  which cannot check the segment, refuses the description (not a device id) instead of
  reading through a mismatch.

Giving up a read. Over UCX, releasing a READ still in progress returns without
error but does not stop it: the GET may still land in our memory later (NIXL issue
#1958: the handle is freed, the request is not). So a transfer is over only when NIXL
reports it final (``DONE`` or ``ERR``). ``release`` of a pending one stops it the way
UCX does honour: it disconnects that holder's agent (``remove_remote_agent``: the UCX
endpoint is closed, which cancels every request on it, and NIXL then reports each
``ERR``), and frees the handle only once NIXL reports it final; until then it answers
False, and the caller keeps the read (its memory fenced, its source pinned: contract
3) and asks again. Every other read from that holder ends too (as failed: re-planned);
the next read from it connects again (``add_peer``). Measured on one host (UCX over
shared memory): a READ pending on a stalled holder is ``ERR`` at once after the
disconnect, and nothing the holder wrote after resuming reached the reader.

Closing: likewise ``close`` releases every transfer (stopping pending ones as above),
for up to ``timeout`` (5 s), and drops the agent only once none is left; one that
stays pending keeps the agent alive (a leak, logged, rather than memory written after
its owner freed it).

Completion. NIXL's Python API has no completion callback (``check_xfer_state`` and
``get_new_notifs`` are polls), so ``when_over`` is the base's: one watcher thread per
engine (``engines.watcher``: the one poll left, backing off 20 µs to 1 ms, or 4 ms where
NIXL's progress thread moves the bytes, while reads are pending; while paced it also
calls ``progress`` on the same wakes; asleep with no CPU while none is watched and
nothing paced) checks every watched READ in one round under the lock; without NIXL's
progress thread its checks also drive UCX progress for our READs. A transfer already
released (given up, or by ``close``) is never checked again: it reads "failed".
``close`` stops the thread.

NIXL calls are serialized by one lock: the fetch loop, the watcher's checks and
progress, and the peer server's ``describe`` run on different threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import NamedTuple

import msgspec

from . import nixl_progress
from .base import Engine, EngineError, Pair, Region, State
from .nixl_shim import UCX_TCP_SEGMENTS, load_nixl, tcp_segments

_STATES = {"DONE": "done", "PROC": "pending"}
log = logging.getLogger("tensorhub.nixl")


class NixlPeer(NamedTuple):
    """What ``add_peer`` returns: the remote agent, its memory kind and device id."""

    agent: str
    mem: str  # "DRAM" or "VRAM"
    device: int  # the holder's CUDA device (VRAM); 0 for DRAM, as NIXL counts host memory


def _where(mem: str, device: int) -> str:
    return f"cuda:{device}" if mem == "VRAM" else "host memory"


class _Registered(NamedTuple):
    mem: str
    reg: object  # NIXL's registration descriptor list
    device: int


class NixlEngine(Engine):
    kind = "nixl"
    needs_progress = True

    def __init__(self, name: str, device: int | None = None):
        """``device``: the CUDA device this process's tensors live on, when known (it
        picks this process's NIC from a per-GPU ``ucx_net_devices``: ``nixl_shim``)."""
        nixl = load_nixl() if device is None else load_nixl(device)
        self._tcp_tx, self._tcp_rx = tcp_segments(os.environ)  # (as UCX reads them: load_nixl set them)
        self._lock = threading.Lock()
        self._posted: dict = {}  # transfer handles not released yet -> the remote agent each reads
        self._sizes: dict = {}  # the same handles -> bytes each reads (the watcher's predictions)
        self._agent, thread = nixl_progress.make_agent(nixl, f"{name}.{os.getpid()}",
                                                       nixl_progress.wanted(os.environ))
        self.needs_progress = not thread  # (NIXL's own thread progresses UCX: nixl_progress)
        if thread:  # (the watcher's checks only notice an end then: they need not come every ms)
            self.watch_ceiling_s = nixl_progress.WATCH_CEILING_S

    @staticmethod
    def _mem(regions: list[Region]) -> tuple[str, int, list[tuple[int, int, int, str]]]:
        """Memory kind, device id and NIXL descriptors of one registration."""
        devices = {r.device for r in regions}
        if len(devices) > 1:
            raise EngineError(f"one registration covers one device, not {sorted(devices)} (-1: host memory)")
        device = devices.pop() if devices else -1
        mem, dev_id = ("VRAM", device) if device >= 0 else ("DRAM", 0)
        return mem, dev_id, [(r.addr, r.nbytes, dev_id, "") for r in regions]

    def register(self, regions: list[Region]) -> object:
        mem, device, descs = self._mem(regions)
        with self._lock:
            return _Registered(mem, self._agent.register_memory(descs, mem_type=mem), device)

    def describe(self, handle: object) -> bytes:
        mem, reg, device = handle
        with self._lock:
            md = self._agent.get_partial_agent_metadata(reg, inc_conn_info=True)
        return msgspec.msgpack.encode([mem, md, {"device": device, "tcp_tx_seg": self._tcp_tx}])

    def deregister(self, handle: object) -> None:
        with self._lock:
            self._agent.deregister_memory(handle.reg)

    def add_peer(self, address: str, description: bytes) -> object:
        try:
            mem, md, *rest = msgspec.msgpack.decode(description)
            held = rest[0] if rest else 0  # (an older holder's: a bare device id, or none, meaning 0)
            device, tx = ((held.get("device"), held.get("tcp_tx_seg")) if isinstance(held, dict)
                          else (held, UCX_TCP_SEGMENTS[0]))  # (and UCX's default segments)
            if mem not in ("DRAM", "VRAM") or not isinstance(device, int) or device < 0:
                raise ValueError(f"memory {mem!r} on device {device!r}")
            if tx is not None and not (isinstance(tx, int) and tx > 0):
                raise ValueError(f"a TCP send segment of {tx!r}")
        except Exception as exc:
            raise EngineError(f"cannot load NIXL metadata of {address}: {exc}") from exc
        if tx is not None and self._tcp_rx is not None and tx > self._tcp_rx:
            raise EngineError(f"{address} sends UCX TCP segments of {tx} bytes, larger than this process's "
                              f"receive segment of {self._tcp_rx} (UCX_TCP_RX_SEG_SIZE); UCX would write past "
                              f"it. Set UCX_TCP_RX_SEG_SIZE to at least {tx} here, or the same UCX_TCP_* "
                              f"variables on every node")
        try:
            with self._lock:
                return NixlPeer(self._agent.add_remote_agent(md), mem, device)
        except Exception as exc:  # nixl raises its own binding errors
            raise EngineError(f"cannot load NIXL metadata of {address}: {exc}") from exc

    def read(self, peer: object, pairs: list[Pair], device: int = -1, remote_device: int | None = None) -> object:
        agent, remote_mem, described = peer
        if remote_device is not None:
            named = ("VRAM", remote_device) if remote_device >= 0 else ("DRAM", 0)
            if named != (remote_mem, described):
                who = agent.decode() if isinstance(agent, bytes) else agent
                raise EngineError(f"read names the holder's memory as {_where(*named)}, but {who} described "
                                  f"{_where(remote_mem, described)}")
        mem = "VRAM" if device >= 0 else "DRAM"
        dev = max(device, 0)
        try:
            with self._lock:
                local = self._agent.get_xfer_descs([(p.local, p.nbytes, dev) for p in pairs], mem_type=mem)
                remote = self._agent.get_xfer_descs([(p.remote, p.nbytes, described) for p in pairs],
                                                    mem_type=remote_mem)
                handle = self._agent.initialize_xfer("READ", local, remote, agent)
                if self._agent.transfer(handle) == "ERR":
                    self._agent.release_xfer_handle(handle)
                    raise EngineError("NIXL refused to start the READ")
                self._posted[handle] = agent
                self._sizes[handle] = sum(p.nbytes for p in pairs)
                return handle
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"NIXL READ could not start: {type(exc).__name__}: {exc}") from exc

    def size_of(self, transfer: object) -> int:
        return self._sizes.get(transfer, 0)

    def state(self, transfer: object) -> State:
        try:
            with self._lock:
                return _STATES.get(self._agent.check_xfer_state(transfer), "failed")
        except Exception:
            return "failed"

    def states_of(self, transfers: list) -> list[State]:
        """The watcher's round: every state under one lock; a released handle is
        never touched again (NIXL freed it)."""
        with self._lock:
            return [self._watched_state(t) for t in transfers]

    def _watched_state(self, transfer: object) -> State:
        """(Under the lock.)"""
        if self._agent is None or transfer not in self._posted:
            return "failed"
        try:
            return _STATES.get(self._agent.check_xfer_state(transfer), "failed")
        except Exception:
            return "failed"

    def release(self, transfer: object) -> bool:
        """True only once NIXL reports ``transfer`` final and its handle is freed; a
        pending one is stopped by disconnecting its holder first (see the module)."""
        with self._lock:
            return self._release_final(transfer)

    def _release_final(self, transfer: object) -> bool:
        """(Under the lock.)"""
        if self._pending(transfer):
            agent = self._posted.get(transfer)
            try:  # (the only stop UCX honours; a second disconnect of the same agent raises: harmless)
                self._agent.remove_remote_agent(agent)
                log.info("disconnected %s to stop a READ given up on", agent)
            except Exception:
                pass
            if self._pending(transfer):
                return False
        try:
            self._agent.release_xfer_handle(transfer)
        except Exception:
            return False
        self._posted.pop(transfer, None)
        self._sizes.pop(transfer, None)
        return True

    def _pending(self, transfer: object) -> bool:
        try:
            return self._agent.check_xfer_state(transfer) == "PROC"
        except Exception:  # (an unknown handle is no transfer of ours in flight: free what can be)
            return False

    def progress(self) -> None:
        """After ``close`` dropped the agent there is nothing left to serve: a pace the
        endpoint has not lifted yet must not fail (and log) on the way out."""
        with self._lock:
            if self._agent is not None:
                self._agent.get_new_notifs()

    def close(self, timeout: float = 5.0) -> None:
        """Release every posted transfer (bounded by ``timeout``), then drop the agent;
        see the module's docstring for one that will not let go. Stops the watcher."""
        try:
            self._release_all(timeout)
        finally:
            self._stop_watching(timeout)

    def _release_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._agent is None:
                    return
                for handle in list(self._posted):
                    self._release_final(handle)  # (still in flight: it may yet write into our memory)
                if not self._posted:
                    self._agent = None
                    return
            if time.monotonic() >= deadline:
                log.warning("%d NIXL transfer(s) still in flight after %.1fs; keeping the agent alive",
                            len(self._posted), timeout)
                return
            time.sleep(0.01)
