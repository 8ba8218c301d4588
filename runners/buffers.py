"""A rollout's weight buffers, and the background fetch that double-buffers them.

Protocol. A ``Buffer`` is one copy of the model whose parameters (plus a buffer for
the version's probe) are a fetch destination: once a version is fetched into it,
that memory is published (other readers read from it) until it is unpublished.

In-place rollouts have one buffer: generation pauses while the next version lands
in it, and the endpoint unpublishes the old version the moment that fetch starts.

Double-buffered rollouts have two, ``active`` (generation reads it) and ``spare``.
A ``Fetcher`` thread owns the spare:

1. it asks for ``latest`` (one hub round trip per ``poll_s``); while that is the
   active version, nothing moves.
2. a newer version: first the spare's old version is unpublished (that returns after
   the drain and any retention copy the hub asks for first, contract 4); this is the
   only unpublish, and it comes after that version was swapped out. Then the new
   version is fetched into the spare, verified (checksums and probe, ``check``) and
   offered (``ready``). Meanwhile the active version stays published and serving.
3. the generating thread takes it at its next window (``swap``): the two buffers
   trade roles, which is the only pause generation sees; the fetcher resumes only
   after that, with the old active as its spare (still published: readers of that
   version keep a holder until a newer one needs the memory).

So at most two versions are held, in two buffers allocated once. A version that was
published and superseded while a fetch ran is skipped: the next fetch takes the newest.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from tensorhub_cli.endpoint import FetchError
from tensorhub_cli.hub.client import HubError

from . import model as M
from .common import emit

POLL_S = 0.05  # how often an idle fetcher asks the hub for `latest`


@dataclass
class Buffer:
    net: nn.Module
    probe: torch.Tensor
    into: dict[str, torch.Tensor] = field(default_factory=dict)  # the fetch destination: parameters + probe
    version: int = 0  # the version it holds (published); 0: none

    @classmethod
    def build(cls, cfg: M.ModelConfig) -> "Buffer":
        net = M.build(cfg)
        probe = torch.empty_like(M.probe(net))
        return cls(net, probe, {**M.weights(net), M.PROBE: probe})


def check(ep, model: str, version: int, buf: Buffer) -> Optional[dict]:
    """None when ``buf`` is byte for byte ``model@version`` and its probe recomputed
    from those weights equals the trainer's bit for bit; else the mismatch event."""
    problems = ep.verify(model, version, buf.into)
    mine = M.probe(buf.net)
    if not problems and torch.equal(mine, buf.probe):
        return None
    diff = float((mine - buf.probe).abs().max()) if mine.shape == buf.probe.shape else float("nan")
    return {"version": version, "problems": problems[:5], "probe_max_abs_diff": diff}


@dataclass
class Ready:
    """A version fetched and checked in the spare buffer, waiting for the swap."""

    version: int
    began: float  # wall clock, when its fetch started
    fetch_s: float  # fetch + check, in the background
    stats: dict


class Fetcher(threading.Thread):
    """Fills the spare buffer with each newer version (see the module docstring).
    ``ready``, ``mismatch`` and ``error`` are what the generating thread watches."""

    def __init__(self, ep, args, active: Buffer, spare: Buffer, stopping: threading.Event):
        super().__init__(name="fetcher", daemon=True)
        self.ep, self.args, self.stopping = ep, args, stopping
        self.active_version = active.version
        self.spare = spare
        self.ready: Optional[Ready] = None
        self.mismatch: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self._taken = threading.Event()

    def swap(self, active: Buffer) -> tuple[Buffer, Ready]:
        """The generating thread's half of step 3: hand over the active buffer, get the
        spare with its version. Call only while ``ready`` is set."""
        ready, new = self.ready, self.spare
        self.spare, self.active_version, self.ready = active, ready.version, None
        return new, ready

    def resume(self) -> None:
        """After the swap was announced: the fetcher may touch its (new) spare."""
        self._taken.set()

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the generating thread raises it
            self.error = exc

    def _prepare(self, _shards) -> dict[str, torch.Tensor]:
        """Called by the fetch once it named a version we do not hold: free the spare."""
        old = self.spare.version
        if old:
            t0 = time.monotonic()
            self.ep.unpublish(self.args.model_name, old, timeout=self.args.drain_timeout_s or 120.0)
            self.spare.version = 0
            emit("unpublished", version=old, drain_s=time.monotonic() - t0)
        return self.spare.into

    def _loop(self) -> None:
        a = self.args
        while not self.stopping.is_set():
            t0, began = time.monotonic(), time.time()
            try:
                # A callable destination: a version we hold (the active one) returns at
                # once, without touching the spare.
                version = self.ep.fetch(a.model_name, "latest", into=self._prepare, group=a.group,
                                        timeout=a.fetch_timeout_s, window=a.window, wait=False)
            except HubError as exc:
                if exc.code != "not_found":
                    raise
                self.stopping.wait(POLL_S)
                continue
            except FetchError as exc:  # the spare holds nothing now; the active one serves on
                self.spare.version = 0
                emit("retry", reason=str(exc), began=began, stall_s=0.0, background=True)
                self.stopping.wait(POLL_S)
                continue
            if version == self.active_version:
                self.stopping.wait(POLL_S)
                continue
            self.spare.version = version
            stats = dict(self.ep.last_fetch)
            bad = check(self.ep, a.model_name, version, self.spare)
            if bad:
                self.mismatch = bad
                return
            self._taken.clear()
            self.ready = Ready(version, began, time.monotonic() - t0, stats)
            while not self._taken.wait(0.1):  # the spare is the generating thread's to take
                if self.stopping.is_set():
                    return
