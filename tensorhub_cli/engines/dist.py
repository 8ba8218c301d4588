"""torch.distributed as the byte mover of a collective stage: gloo on CPU, NCCL on GPU.

Protocol. ``Collective(pg, deadline=..., timeout=..., what=...)`` wraps a process
group for one collective fetch. Every member calls the same methods in the same order
(that is torch.distributed's contract, not ours):

- ``agree(stage, ok, value)``: one ``(ok, value)`` pair per member, in group rank
  order (all-gather of two int64s): how members tell each other a stage's outcome, so
  a member that failed on its own makes the others fail at the same point instead of
  waiting in a collective it will never join.
- ``all_gather(stage, send)``: every member's equally sized ``send`` buffer, in rank
  order. ``broadcast(stage, buf, root)``: ``root``'s ``buf`` into everyone's.

Tensors live where the backend wants them: CPU for gloo, the current CUDA device for
NCCL (``device``; a group with both backends takes either). Every call is issued
``async_op=True`` and polled until it completes or ``deadline`` (monotonic) passes, so
no member waits longer than its fetch's timeout whatever the others do: a member that
died closes its sockets and gloo fails the others at once (those it exchanges with
directly; the rest at the deadline); one that hangs is given up at the deadline. Both
raise ``CollectiveError`` (a ``FetchError``) naming the stage, this member and the
timeout. After that the process group is unusable: its members disagree on which
collective comes next; the caller makes a new one (torchrun restarts the job). A
given-up call's buffers are kept referenced here, since the backend may still write
them.

Not an ``Engine`` (register/read/state/release): a collective moves bytes between
members that all take part, not one-sided reads of a holder's memory, so nothing is
registered and nothing is pinned at the hub.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import BadArgument, FetchError

# Calls given up at their deadline, with the buffers the backend may still write.
_ABANDONED: list[tuple[object, object]] = []


class CollectiveError(FetchError):
    """A collective stage did not complete: a member died, hung or failed."""


def check_group(pg: object) -> dist.ProcessGroup:
    """``pg`` if it is a process group this process is a member of; else ``BadArgument``."""
    if not dist.is_available() or not dist.is_initialized():
        raise BadArgument("collective takes a torch.distributed process group, and torch.distributed is not "
                          "initialized in this process (call torch.distributed.init_process_group first)")
    if not isinstance(pg, dist.ProcessGroup):
        raise BadArgument("collective takes a torch.distributed ProcessGroup (dist.group.WORLD, "
                          f"dist.new_group(...)), not {type(pg).__name__}")
    if dist.get_rank(pg) < 0:
        raise BadArgument("collective names a process group this process is not a member of")
    return pg


def backend_device(pg: dist.ProcessGroup, want: torch.device) -> torch.device:
    """Where this group's buffers go: ``want`` (the destination's device) when the
    group's backend moves that kind of memory; else ``BadArgument``."""
    backend = str(dist.get_backend(pg)).lower()
    if want.type == "cuda" and "nccl" not in backend and "gloo" not in backend:
        raise BadArgument(f"collective: a {backend} process group cannot move CUDA memory; use nccl")
    if want.type == "cpu" and "gloo" not in backend:
        raise BadArgument(f"collective: a {backend} process group cannot move host memory; use gloo "
                          "(or a group with both, e.g. backend='cpu:gloo,cuda:nccl')")
    return want


class Collective:
    def __init__(self, pg: dist.ProcessGroup, *, deadline: float, timeout: float, what: str,
                 device: torch.device = torch.device("cpu")):
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.size = dist.get_world_size(pg)
        self.deadline = deadline
        self.timeout = timeout
        self.what = what
        self.device = device

    def agree(self, stage: str, ok: bool, value: int = 0) -> list[tuple[bool, int]]:
        mine = torch.tensor([0 if ok else 1, value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._run(stage, lambda: dist.all_gather(out, mine, group=self.pg, async_op=True), (out, mine))
        return [(int(o[0]) == 0, int(o[1])) for o in torch.stack(out).cpu()]

    def all_gather(self, stage: str, send: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(send) for _ in range(self.size)]
        self._run(stage, lambda: dist.all_gather(out, send, group=self.pg, async_op=True), (out, send))
        return out

    def broadcast(self, stage: str, buf: torch.Tensor, root: int) -> None:
        src = dist.get_global_rank(self.pg, root)
        self._run(stage, lambda: dist.broadcast(buf, src=src, group=self.pg, async_op=True), buf)

    def error(self, stage: str, why: str) -> CollectiveError:
        return CollectiveError(f"collective stage {stage!r} of {self.what} (member {self.rank} of {self.size}) "
                               f"{why} (fetch timeout {self.timeout:g}s); the process group is unusable now")

    def _run(self, stage: str, start, keep) -> None:
        try:
            work = start()
        except Exception as exc:  # (a backend that already saw a member go)
            raise self.error(stage, f"could not start: {exc}") from None
        pause = 0.0001
        while not work.is_completed():
            left = self.deadline - time.monotonic()
            if left <= 0:
                _ABANDONED[:] = [(w, k) for w, k in _ABANDONED if not w.is_completed()] + [(work, keep)]
                raise self.error(stage, "did not complete within the timeout: a member died or hung")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.002)
        try:
            work.wait()  # (raises what the backend saw; for NCCL, orders the current stream after it)
        except Exception as exc:
            raise self.error(stage, f"failed: a member left or failed ({exc})") from None
