"""What memory a tensor is, for layouts: its device, its bytes, whether it can register.

Protocol. ``flat_bytes(t)`` is a flat uint8 view of ``t``'s memory (same memory: a
write through it changes ``t``). ``check_tensors`` lists every reason a state_dict
cannot be registered as-is (all of them, not the first), and the one device it lives
on (-1: host). ``LayoutError`` carries such a list; nothing has been written or
registered when one is raised.
"""

from __future__ import annotations

from ..errors import LayoutError  # noqa: F401 (re-exported; defined with the rest of the public errors)


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def device_of(t) -> int:
    """-1 for host memory, else the CUDA device index (an engine registers by it)."""
    return (t.device.index or 0) if t.device.type == "cuda" else -1


def flat_bytes(t):
    """The tensor's memory as a flat uint8 tensor (a view: same memory)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def check_tensors(state_dict: dict) -> tuple[list[str], int]:
    import torch

    problems, devices = [], set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(t).__name__})")
            continue
        if not t.is_contiguous():
            problems.append(f"{name}: not contiguous (call .contiguous() first: registration needs one span)")
        if t.device.type not in ("cpu", "cuda"):
            problems.append(f"{name}: device {t.device} (only cpu and cuda memory register)")
        devices.add(device_of(t))
    if len(devices) > 1:
        problems.append(f"tensors live on several devices {sorted(devices)}; publish one device per endpoint")
    return problems, devices.pop() if devices else -1
