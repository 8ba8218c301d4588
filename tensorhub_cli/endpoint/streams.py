"""Stream order: what the endpoint waits for on a CUDA device, and what it makes others wait for.

Protocol. Engines move bytes outside every CUDA stream (a NIXL/UCX transfer, a tcp
read's copy), so stream order alone never orders them against kernels:

- ``caught_up(devices, ready)``, before ``publish`` hashes and registers its tensors:
  with ``ready`` None, the current stream of each device the tensors live on is
  synchronized (every kernel the caller queued on it has run); with ``ready`` (a list
  of ``torch.cuda.Event``, ``events`` makes one), the host waits for those events
  instead, for work queued on other streams. Once more on the current stream after
  the publish's own async copies into its staging buffer, before readers are let in.
- ``scattered(device)``, after each scatter of a fetch (a staged chunk reaches its
  tensors by async ``copy_`` on the fetch thread's current stream): an event recorded
  on that stream, kept on the replica (``Replica.written``), so the last one marks the
  last scatter. ``reached(device, event)``, before ``fetch`` returns (also one that
  found the version filled by another thread): the caller's current stream waits on
  it, so the scattered bytes are visible on it without blocking the host.
  ``passed(event)`` blocks the host until it has passed: before a staging buffer is
  written by an engine again or let go (the copies read it).

Every call goes through the module-level hook ``_streams`` (``Streams``: torch's CUDA
calls, a no-op for host memory, device -1). Tests replace it with a recorder, so the
order is checked on machines without a GPU (``tests/unit/test_stream_order.py``).

Not yet run on a GPU; a GPU run must confirm: a publish right after a kernel that is
still writing the tensors (no synchronize by the caller) hashes and serves the final
bytes, with and without ``ready``; a fetch whose chunks span tensors, followed at once
by a kernel on the caller's stream (another stream than the verifiers'), sees the new
bytes; and NIXL VRAM reads of a reused registration (version 2 of in-place memory)
by a reader that loads the holder's description again are correct.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import BadArgument


class _Nothing:
    """Host memory's stream and event: nothing is ever pending."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class Streams:
    """torch's CUDA streams and events; for device -1 (host memory) nothing waits."""

    def current_stream(self, device: int) -> Any:
        if device < 0:
            return _Nothing()
        import torch

        return torch.cuda.current_stream(device)

    def synchronize(self, device: int) -> None:
        """Block until every kernel queued on ``device``'s current stream has run."""
        if device >= 0:
            import torch

            torch.cuda.current_stream(device).synchronize()

    def event(self, device: int) -> Any:
        if device < 0:
            return _Nothing()
        import torch

        with torch.cuda.device(device):
            return torch.cuda.Event()


_streams: Streams = Streams()


def events(ready: object, what: str = "ready") -> Optional[list]:
    """``ready`` as a list of events (None stays None), or ``BadArgument`` naming ``what``."""
    if ready is None:
        return None
    items = list(ready) if isinstance(ready, (list, tuple)) else [ready]
    for ev in items:
        if not callable(getattr(ev, "synchronize", None)):
            raise BadArgument(f"{what} takes a torch.cuda.Event or a list of them, not {type(ev).__name__}")
    return items


def caught_up(devices, ready: Optional[list]) -> None:
    if ready is None:
        for device in sorted(devices):
            _streams.synchronize(device)
        return
    for ev in ready:
        ev.synchronize()


def scattered(device: int) -> Any:
    event = _streams.event(device)
    event.record(_streams.current_stream(device))
    return event


def reached(device: int, event: Optional[Any]) -> None:
    if event is not None:
        _streams.current_stream(device).wait_event(event)


def passed(event: Optional[Any]) -> None:
    if event is not None:
        event.synchronize()
