"""NIXL engine: one-sided UCX READs of registered host (DRAM) or CUDA (VRAM) memory.

Defaults (the figures behind them: docs/design.md, "Measurements behind the defaults"):

- ``UCX_MODULES=^ib`` (set by ``nixl_shim``): UCX's InfiniBand module makes a process
  that created a backend die with SIGSEGV at exit on hosts without RDMA devices.
- No progress thread (``enable_prog_thread=False``): the wrapper's thread spins a full
  core per agent even when idle. Our endpoint calls ``progress`` from its service
  thread instead: every millisecond while peers are reading us, every 10 ms otherwise.
- The passive side must progress: without it a holder never answers the rendezvous
  and a READ stays pending forever, over shared memory and TCP alike.
- Transports are left to UCX (between processes of one host it picks shared memory).
  ``UCX_TLS=cma,self`` or ``sm,self`` fail to create the backend ("no active messages
  transport"), so we never narrow UCX_TLS ourselves.
- Logging: the wrapper logs INFO lines to stdout; ``load_nixl`` moves them to stderr.
- Metadata: ``describe`` returns partial agent metadata (the handle's regions plus
  connection info). Loading it again for a known agent adds the new regions (checked),
  so one remote agent per holder serves every version it publishes.

Closing: UCX may still write into local memory for a READ that is posted, so
``close`` releases every transfer not yet released (NIXL aborts a posted one, or
refuses while it cannot) for up to ``timeout`` (5 s), and drops the agent only once
none is left; one that would not let go keeps the agent alive (a leak, logged, rather
than memory written after its owner freed it).

NIXL calls are serialized by one lock: the fetch loop, the service thread's progress
and the peer server's ``describe`` run on different threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import msgspec

from .base import Engine, EngineError, Pair, Region, State
from .nixl_shim import load_nixl

_STATES = {"DONE": "done", "PROC": "pending"}
log = logging.getLogger("tensorhub.nixl")


class NixlEngine(Engine):
    kind = "nixl"
    needs_progress = True

    def __init__(self, name: str):
        nixl = load_nixl()
        self._lock = threading.Lock()
        self._posted: set = set()  # transfer handles not released yet
        self._agent = nixl.nixl_agent(
            f"{name}.{os.getpid()}", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))

    @staticmethod
    def _mem(regions: list[Region]) -> tuple[str, list[tuple[int, int, int, str]]]:
        kinds = {r.device >= 0 for r in regions}
        if len(kinds) > 1:
            raise EngineError("one registration cannot mix host and device memory")
        mem = "VRAM" if kinds == {True} else "DRAM"
        return mem, [(r.addr, r.nbytes, max(r.device, 0), "") for r in regions]

    def register(self, regions: list[Region]) -> object:
        mem, descs = self._mem(regions)
        with self._lock:
            return mem, self._agent.register_memory(descs, mem_type=mem)

    def describe(self, handle: object) -> bytes:
        mem, reg = handle
        with self._lock:
            return msgspec.msgpack.encode([mem, self._agent.get_partial_agent_metadata(reg, inc_conn_info=True)])

    def deregister(self, handle: object) -> None:
        with self._lock:
            self._agent.deregister_memory(handle[1])

    def add_peer(self, address: str, description: bytes) -> object:
        try:
            mem, md = msgspec.msgpack.decode(description)
            with self._lock:
                return self._agent.add_remote_agent(md), mem
        except Exception as exc:  # nixl raises its own binding errors
            raise EngineError(f"cannot load NIXL metadata of {address}: {exc}") from exc

    def read(self, peer: object, pairs: list[Pair], device: int = -1) -> object:
        agent, remote_mem = peer
        mem = "VRAM" if device >= 0 else "DRAM"
        dev = max(device, 0)
        try:
            with self._lock:
                local = self._agent.get_xfer_descs([(p.local, p.nbytes, dev) for p in pairs], mem_type=mem)
                # A holder's device id is its own business: its registration resolves it.
                remote = self._agent.get_xfer_descs([(p.remote, p.nbytes, 0) for p in pairs], mem_type=remote_mem)
                handle = self._agent.initialize_xfer("READ", local, remote, agent)
                if self._agent.transfer(handle) == "ERR":
                    self._agent.release_xfer_handle(handle)
                    raise EngineError("NIXL refused to start the READ")
                self._posted.add(handle)
                return handle
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"NIXL READ could not start: {type(exc).__name__}: {exc}") from exc

    def state(self, transfer: object) -> State:
        try:
            with self._lock:
                return _STATES.get(self._agent.check_xfer_state(transfer), "failed")
        except Exception:
            return "failed"

    def release(self, transfer: object) -> bool:
        try:
            with self._lock:
                self._agent.release_xfer_handle(transfer)
                self._posted.discard(transfer)
            return True
        except Exception:
            return False

    def progress(self) -> None:
        with self._lock:
            self._agent.get_new_notifs()

    def close(self, timeout: float = 5.0) -> None:
        """Release every posted transfer (bounded by ``timeout``), then drop the agent;
        see the module's docstring for one that will not let go."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self._agent is None:
                    return
                for handle in list(self._posted):
                    try:
                        self._agent.release_xfer_handle(handle)
                        self._posted.discard(handle)
                    except Exception:
                        pass  # still in flight: NIXL could not abort it yet
                if not self._posted:
                    self._agent = None
                    return
            if time.monotonic() >= deadline:
                log.warning("%d NIXL transfer(s) still posted after %.1fs; keeping the agent alive",
                            len(self._posted), timeout)
                return
            time.sleep(0.01)
