"""Find NIXL's Python API whichever backend wheel provides it, and set UCX up for it.

The `nixl` meta-package exposes ``nixl._api``; the backend wheels expose
``nixl_cu13._api`` / ``nixl_cu12._api``. We depend on one backend wheel only, so we
look for each in turn. ``TH_NIXL_MODULE`` (e.g. ``nixl_cu12``) picks one explicitly,
for nodes that have more than one installed.

UCX environment. UCX reads its variables when NIXL creates a backend, so ``load_nixl``
sets them first (``ucx_environment``), and never one the process already has: a user's
``UCX_MODULES`` or ``UCX_NET_DEVICES`` always wins (and so does what an earlier engine
of this process set: the first one decides).

- ``UCX_MODULES=^ib`` only where the host has no InfiniBand device (``/sys/class/
  infiniband`` absent or empty, ``IB_SYSFS``): there UCX's IB module makes a process
  that created a backend die with SIGSEGV at exit. Wherever a device exists IB stays on
  (GPUDirect RDMA; without it UCX falls back to TCP without a word).
- ``UCX_NET_DEVICES`` from ``TH_UCX_NET_DEVICES``, which `th` sets from the node's
  ``ucx_net_devices`` spec field: either one UCX device list for every process of the
  node (``mlx5_0:1`` or ``mlx5_0:1,mlx5_1:1``), or one per GPU separated by ``;``
  (``mlx5_0:1;mlx5_1:1``: GPU 0's, GPU 1's, physical indices as nvidia-smi counts).
  A per-GPU list gives this process its GPU's entry (``process_gpu``); a process whose
  GPU is not known (an agent, or CUDA not initialized yet) gets every entry joined,
  and UCX chooses among them.
- ``UCX_TCP_TX_SEG_SIZE=256k`` and ``UCX_TCP_RX_SEG_SIZE=512k`` (``TCP_SEGMENTS``), for
  hosts where UCX moves a READ over TCP (no RDMA device, or one UCX cannot use). There a
  one-sided READ is emulated: the holder answers it in messages of at most one TX segment,
  each a ``send(2)`` of its own, and UCX's default segment is 8 KiB. On the 8-node testbed
  (N = 7) a relaying reader made 20,539 ``sendto`` calls in 8 s with the defaults, 1,384
  with these, and the fan-out spent 8–11 % less CPU and took 2–7 % less time (two runs,
  rounds of both interleaved on one testbed; docs/design.md, "UCX's TCP segments, and
  what a wake costs"). Both are set, or neither: UCX refuses a receive segment smaller
  than its send segment, so a user who set either keeps UCX's default for the other.
  RDMA transports do not read these variables.
  Peers must agree: UCX sends a segment to a peer without asking that peer's receive
  segment, and one larger than it corrupts the receiver's memory (measured: the bytes
  read were right, and the reader died with SIGSEGV at exit). So a NIXL holder's
  description carries its send segment (``tcp_segments``) and a reader whose receive
  segment is smaller refuses it (``NixlEngine.add_peer``).

NIXL's and UCX's own log lines (``NIXL_ERR_REMOTE_DISCONNECT`` when a peer dies, ``UCX
WARN ... not returned to mpool`` at exit after a fault) are theirs, not ours: we report
every failure in our own words. Where they would land in a terminal (fd 2 is a tty: a
user's script, a runner started by hand) ``log_environment`` turns them down to
``UCX_LOG_LEVEL=error`` and ``NIXL_LOG_LEVEL=FATAL``; where fd 2 is a log file (agents,
runners and hubs `th up` starts, `th bench`'s processes) they are left as they are, so
the logs keep every line. ``TH_VERBOSE=1`` (``th -v`` sets it for what it starts) keeps
them everywhere, and a ``UCX_LOG_LEVEL`` / ``NIXL_LOG_LEVEL`` of the user's always wins
(NIXL takes TRACE, DEBUG, INFO, WARN, ERROR, FATAL; UCX fatal, error, warn, diag, info,
debug, trace).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Mapping, Optional

CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
IB_SYSFS = Path("/sys/class/infiniband")
NET_DEVICES_ENV = "TH_UCX_NET_DEVICES"
VERBOSE_ENV = "TH_VERBOSE"
QUIET_LEVELS = {"UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "FATAL"}
TCP_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "512k"}
UCX_TCP_SEGMENTS = (8 << 10, 64 << 10)  # UCX's own (send, receive), where neither variable is set
log = logging.getLogger("tensorhub.nixl")


class NixlUnavailable(ImportError):
    pass


def _quiet_logging() -> None:
    """NIXL's Python wrapper logs INFO lines to stdout, which corrupts a host program's
    output (``th ... --json``, a runner's protocol): move them to stderr, at WARNING
    unless ``NIXL_LOG_LEVEL`` asks for more."""
    logger = logging.getLogger("nixl")
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)


def ib_devices(root: Optional[Path] = None) -> list[str]:
    """The InfiniBand devices the kernel lists under ``root`` (default ``IB_SYSFS``;
    none when it is absent)."""
    try:
        return sorted(p.name for p in Path(root or IB_SYSFS).iterdir())
    except OSError:
        return []


def process_gpu(device: Optional[int], environ: Mapping[str, str]) -> Optional[int]:
    """The physical index of the GPU this process uses, or None when it cannot tell.
    ``device``: the CUDA device (as the process numbers it) its tensors live on, when
    known; else torch's current device once this process initialized CUDA; else the
    only GPU ``CUDA_VISIBLE_DEVICES`` leaves it. ``CUDA_VISIBLE_DEVICES`` maps a
    process's numbering to the physical one (UUIDs there: unknown)."""
    visible = [v.strip() for v in environ["CUDA_VISIBLE_DEVICES"].split(",")] \
        if environ.get("CUDA_VISIBLE_DEVICES", "").strip() else None
    logical = device if device is not None and device >= 0 else None
    if logical is None:
        torch = sys.modules.get("torch")  # (never imported here: that alone costs seconds)
        if torch is not None and torch.cuda.is_initialized():
            logical = torch.cuda.current_device()
        elif visible is not None and len(visible) == 1:
            logical = 0
    if logical is None:
        return None
    if visible is None:
        return logical
    return int(visible[logical]) if logical < len(visible) and visible[logical].isdigit() else None


def net_devices_for(spec: str, gpu: Optional[int]) -> str:
    """``UCX_NET_DEVICES`` for a process on ``gpu`` (None: unknown) from a node's
    ``TH_UCX_NET_DEVICES`` (see the module's docstring)."""
    entries = [e.strip() for e in spec.split(";")]
    if len(entries) == 1:
        return entries[0]
    if gpu is not None and gpu < len(entries):
        return entries[gpu]
    return ",".join(dict.fromkeys(d for e in entries for d in e.split(",")))


def ucx_environment(environ: Mapping[str, str], *, ib_root: Optional[Path] = None,
                    device: Optional[int] = None) -> dict[str, str]:
    """The UCX variables to set before a backend is created: none the process has."""
    out = {}
    if "UCX_MODULES" not in environ and not ib_devices(ib_root):
        out["UCX_MODULES"] = "^ib"
    spec = environ.get(NET_DEVICES_ENV, "").strip()
    if spec and "UCX_NET_DEVICES" not in environ:
        out["UCX_NET_DEVICES"] = net_devices_for(spec, process_gpu(device, environ))
    if not any(name in environ for name in TCP_SEGMENTS):
        out.update(TCP_SEGMENTS)
    return out


def memunits(text: str) -> Optional[int]:
    """Bytes of a UCX memory-units value (``256k``, ``1m``, ``8kb``, ``65536``); None for
    one we cannot read (``inf``, ``auto``, a typo: UCX's to judge)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", text, re.IGNORECASE)
    return int(m[1]) << 10 * " kmgt".index(m[2].lower() or " ") if m else None


def tcp_segments(environ: Mapping[str, str]) -> tuple[Optional[int], Optional[int]]:
    """(send, receive) segment bytes of UCX's TCP transport in a process whose
    environment is ``environ`` once ``load_nixl`` set it; UCX's own for an unset one."""
    return tuple(default if name not in environ else memunits(environ[name])
                 for name, default in zip(TCP_SEGMENTS, UCX_TCP_SEGMENTS))


def log_environment(environ: Mapping[str, str], interactive: bool) -> dict[str, str]:
    """The log levels to set before NIXL loads: ``QUIET_LEVELS`` (each unless the
    process has it) when its stderr is a terminal (``interactive``) and ``TH_VERBOSE``
    is unset or 0; nothing otherwise (see the module's docstring)."""
    if not interactive or environ.get(VERBOSE_ENV, "").strip() not in ("", "0"):
        return {}
    return {k: v for k, v in QUIET_LEVELS.items() if k not in environ}


def use_net_devices(value: Optional[str]) -> None:
    """What an agent or runner does with its ``--ucx-net-devices`` flag (`th` passes
    the node's ``ucx_net_devices``): keep it in this process's environment, where
    ``load_nixl`` finds it. Call it before the first engine starts."""
    if value:
        os.environ[NET_DEVICES_ENV] = value


def _stderr_is_terminal() -> bool:
    try:
        return os.isatty(2)  # fd 2, not sys.stderr: NIXL and UCX write to the descriptor
    except OSError:
        return False


def load_nixl(device: Optional[int] = None) -> ModuleType:
    """NIXL's API module, with the UCX environment set (``device``: the CUDA device
    this process's tensors live on, when known: it picks the NIC of a per-GPU list)."""
    wanted = os.environ.get("TH_NIXL_MODULE")
    candidates = (f"{wanted.removesuffix('._api')}._api",) if wanted else CANDIDATES
    chosen = {**ucx_environment(os.environ, device=device), **log_environment(os.environ, _stderr_is_terminal())}
    if chosen:
        log.info("UCX/NIXL environment: %s", " ".join(f"{k}={v}" for k, v in chosen.items()))
        os.environ.update(chosen)
    failures = []
    for name in candidates:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if not hasattr(module, "nixl_agent"):
            failures.append(f"{name}: has no nixl_agent")
            continue
        _quiet_logging()
        return module
    raise NixlUnavailable("no NIXL API found (" + "; ".join(failures) + "); install nixl-cu13 or use engine: tcp")
