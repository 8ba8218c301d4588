"""The endpoint process of ``th bench faults`` (``python -m tensorhub_cli.bench.faults``).

``bench.peer``'s JSON-line ops, plus: a ``fetch`` that zeroes its destination first
and counts the bytes that differ from the published tensors afterwards (``lost_bytes``),
an ``unpublish`` that can overwrite the unpublished tensors once it returned (what a
trainer's optimizer step does), ``corrupt`` (flip a byte of every chunk we hold),
``recount`` (lost bytes counted again later), ``stall`` (stop serving NIXL reads a
while) and ``peer_address``.
"""

from __future__ import annotations

import threading
import time

import torch

from ..peer import Peer, serve, tensors
from .rows import HEARTBEAT_S


class FaultPeer(Peer):
    def __init__(self, ep):
        super().__init__(ep)
        self.dsts: dict[str, dict] = {}

    def fetch(self, model: str, version: int, mib: float, window: int = 4, timeout: float = 300) -> dict:
        want = tensors(mib, version)
        dst = self.dsts.get(model)
        if dst is None:
            dst = self.dsts[model] = {k: torch.zeros_like(v) for k, v in want.items()}
        else:  # a stale copy must not hide lost bytes
            for t in dst.values():
                t.zero_()
        t0 = time.monotonic()
        try:
            got = self.ep.fetch(model, version, into=dst, window=window, timeout=timeout)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "t_done": time.monotonic(), "s": time.monotonic() - t0}
        t1 = time.monotonic()
        lost = sum(int((dst[k].view(torch.uint8) != v.view(torch.uint8)).sum()) for k, v in want.items())
        return {"version": got, "s": t1 - t0, "t_done": t1, "lost_bytes": lost, "stats": self.ep.last_fetch}

    def unpublish(self, model: str, version: int, timeout: float = 60, overwrite: bool = False) -> dict:
        """``overwrite``: once unpublish returned, write over the tensors at once, as an
        optimizer step would; a read still running from them would carry that garbage."""
        t0 = time.monotonic()
        try:
            self.ep.unpublish(model, version, timeout=timeout)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "t_done": time.monotonic()}
        t1 = time.monotonic()
        if overwrite:
            for t in self.mine[(model, version)].values():
                t.view(torch.uint8).fill_(0x5A)
        self.mine.pop((model, version), None)
        return {"s": t1 - t0, "t_done": t1}

    def corrupt(self, model: str, version: int) -> dict:
        """Flip one byte of every chunk we hold (the test hook of tests/integration/worker.py)."""
        held = self.ep.replicas.get((model, version))
        if held is None:
            return {"error": f"{self.ep.name} holds no replica of {model}@{version}"}
        views = held.placed.views
        for view in views:
            view[0] = (int(view[0]) + 1) % 256
        return {"corrupted": len(views)}

    def recount(self, model: str, version: int, mib: float) -> dict:
        """``lost_bytes`` of our last fetch of ``model`` counted again now: a given-up
        read that lands after the fetch returned shows here."""
        want, dst = tensors(mib, version), self.dsts[model]
        return {"lost_bytes": sum(int((dst[k].view(torch.uint8) != v.view(torch.uint8)).sum())
                                  for k, v in want.items())}

    def stall(self, seconds: float) -> dict:
        """Stop serving reads for ``seconds`` without stopping the process: NIXL reads
        of our memory need our progress calls, which wait for the engine's lock (our
        peer channel still answers, from the description it cached)."""
        lock = getattr(self.ep.engine, "_lock", None)
        if lock is None:
            return {"error": f"the {self.ep.engine.kind} engine has no progress to stall"}
        for held in self.ep.replicas.all():  # (our peer channel answers from these while the engine is held)
            held.described(self.ep.engine)
        taken, until = threading.Event(), []

        def hold() -> None:
            with lock:
                until.append(time.monotonic() + seconds)
                taken.set()
                time.sleep(seconds)

        threading.Thread(target=hold, daemon=True).start()
        taken.wait(5)
        return {"until": until[0]}  # (monotonic: one clock for every process of this host)

    def peer_address(self) -> dict:
        return {"address": self.ep.peer.address}


def main() -> int:
    return serve(FaultPeer, heartbeat_s=HEARTBEAT_S)
