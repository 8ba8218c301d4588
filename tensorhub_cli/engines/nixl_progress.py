"""Who drives UCX progress for a NIXL agent: NIXL's own progress thread, woken by the
network, or the engine's watcher thread, on the pace our endpoint sets.

Why it matters. A one-sided READ over TCP or shared memory is emulated: the holder's
UCX worker must be progressed to send the bytes. Progress on a timer costs CPU for as
long as readers are at us, whatever they read (a 1 ms loop, then the service thread's, spent
0.35–0.45 CPU-s serving 256 MiB over a 500 Mbit/s link; docs/design.md, "Measurements
behind the defaults"). NIXL's UCX progress thread instead arms the worker and sleeps in
``poll`` on its event descriptors, so it wakes when bytes can move: 0.10 CPU-s for the
same read, and 0.5 % of a core idle. Its poll timeout (``pthrDelay``, µs, rounded up to
whole ms) is only a safety net for a wake-up UCX misses; NIXL's Python wrapper pins it
at 0, which makes the thread spin a full core, so ``make_agent`` sets it itself.

Protocol. ``wanted(environ)`` says whether this process should run the thread;
``make_agent(nixl, name, thread)`` builds the agent accordingly and says whether the
thread runs. With it, the engine does not need ``progress`` calls
(``NixlEngine.needs_progress`` False); without it, the watcher calls ``progress`` at
the endpoint's pace (``Engine.pace``).

When. ``TH_NIXL_PROGRESS_THREAD=1`` or ``0`` decides outright. Otherwise the thread
runs only on hosts without an NVIDIA device (``/dev/nvidia<N>``): on CUDA hosts it
would arm UCX's ``cuda_copy`` transport from a thread with no CUDA context, which NIXL
issue #2102 reports crashing with SIGSEGV (there RDMA reads need no progress from the
holder anyway, and the watcher keeps the TCP and shared-memory fallbacks moving).
History: from 2026-12-06 to 2026-12-07 the thread ran only when asked, because with a
chain read in fragments (1 MiB reads, 17 ms at 500 Mbit/s) its reads were noticed late
and N = 7 took 2.85–3.07 s against 2.55–2.76 s. The watcher has since learned to
predict a read's end and to check near it (``engines.watcher``), and UCX's TCP
segments grew (``nixl_shim.TCP_SEGMENTS``): interleaved on the 8-node testbed, N = 7,
128 MiB, the thread cost 3.28 and 3.21 CPU-s per GiB against the watcher's 3.81 and
3.57 (−14 %, −10 %; 4 and 6 rounds an arm) for 2.472 against 2.452 s and 2.487 against
2.451 s (+0.8 %, +1.5 %) (docs/design.md, "Measurements behind the defaults").
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from types import ModuleType
from typing import Mapping, Optional

ENV = "TH_NIXL_PROGRESS_THREAD"
DELAY_US = 10_000  # the thread's poll timeout: a missed wake-up costs at most this
WATCH_CEILING_S = 4e-3  # the watcher's back-off ceiling with the thread (engines.watcher)
DEV = Path("/dev")
_NVIDIA = re.compile(r"nvidia\d+$")
log = logging.getLogger("tensorhub.nixl")
_build = threading.Lock()  # (one agent built at a time: the wrapper's module is patched meanwhile)


def cuda_host(dev: Optional[Path] = None) -> bool:
    """Whether the host has an NVIDIA GPU device node (``/dev/nvidia0`` …)."""
    try:
        return any(_NVIDIA.match(p.name) for p in Path(dev or DEV).iterdir())
    except OSError:
        return False


def wanted(environ: Mapping[str, str], dev: Optional[Path] = None) -> bool:
    """Run NIXL's progress thread in this process? (See the module's docstring.)"""
    value = environ.get(ENV, "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"{ENV}: want 0 or 1, got {value!r}")
    return not cuda_host(dev)


class _Delayed:
    """NIXL's binding module as its wrapper sees it while building one agent: the same
    module, except that the agent's config gets our progress-thread delay."""

    def __init__(self, bind: ModuleType, delay_us: int):
        self._bind, self._delay_us = bind, delay_us

    def __getattr__(self, name: str):
        return getattr(self._bind, name)

    def nixlAgent(self, name, config):  # noqa: N802 (the binding's name)
        config.pthrDelay = self._delay_us
        return self._bind.nixlAgent(name, config)


def settable(nixl: ModuleType) -> bool:
    """Whether this NIXL wrapper builds its agents through a binding whose config has
    the thread's delay (``pthrDelay``), which ``make_agent`` can then set."""
    bind = getattr(nixl, "nixlBind", None)
    try:
        return bind is not None and hasattr(bind.nixlAgentConfig(), "pthrDelay")
    except Exception:
        return False


def make_agent(nixl: ModuleType, name: str, thread: bool, delay_us: int = DELAY_US) -> tuple[object, bool]:
    """(a UCX ``nixl_agent``, whether NIXL's progress thread runs in it). The thread
    (polling at most every ``delay_us``) only where asked and the wrapper lets us set
    its delay: another wrapper would spin it a full core, so it gets none (logged), and
    the caller progresses the agent itself. Once it returns, the agent is ready for use."""
    if thread and not settable(nixl):
        log.warning("this NIXL wrapper (%s) offers no progress-thread delay; progressing UCX from the "
                    "engine's watcher thread instead", getattr(nixl, "__name__", nixl))
        thread = False
    config = nixl.nixl_agent_config(enable_prog_thread=thread, backends=["UCX"])
    if not thread:
        return nixl.nixl_agent(name, config), False
    with _build:
        bind = nixl.nixlBind
        nixl.nixlBind = _Delayed(bind, delay_us)
        try:
            return nixl.nixl_agent(name, config), True
        finally:
            nixl.nixlBind = bind
