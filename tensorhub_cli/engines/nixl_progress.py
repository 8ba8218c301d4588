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

When. Only with ``TH_NIXL_PROGRESS_THREAD=1``; by default (or ``0``) the watcher
progresses, on every host. Two reasons. On CUDA hosts the thread arms UCX's
``cuda_copy`` transport from a thread with no CUDA context, which NIXL issue #2102
reports crashing with SIGSEGV (there RDMA reads need no progress from the holder
anyway). And since a chain's chunks are read in fragments (``endpoint.reader``), reads
are short (17 ms for 1 MiB at 500 Mbit/s), and the thread noticed their ends late: on
the 8-node testbed, N = 7, the watcher found a read over a median 3.5 ms after the last
check that found it pending, against 1.1 ms with the service thread's progress (the
watcher's checks drove UCX themselves), and the version took 2.85–3.07 s against 2.55–2.76 s
(docs/design.md, "Fragments"). Measured again once the watcher predicted ends and UCX's
TCP segments grew: 10–14 % less CPU for 1–1.5 % more time, but with it one testbed
test's plain fetch stalled in 2 runs of 20 (none in 10 without), not explained yet
(docs/design.md, "Measurements behind the defaults"), so it stays opt-in.
"""

from __future__ import annotations

import logging
import threading
from types import ModuleType
from typing import Mapping

ENV = "TH_NIXL_PROGRESS_THREAD"
DELAY_US = 10_000  # the thread's poll timeout: a missed wake-up costs at most this
WATCH_CEILING_S = 4e-3  # the watcher's back-off ceiling with the thread (engines.watcher)
log = logging.getLogger("tensorhub.nixl")
_build = threading.Lock()  # (one agent built at a time: the wrapper's module is patched meanwhile)


def wanted(environ: Mapping[str, str]) -> bool:
    """Run NIXL's progress thread in this process? (See the module's docstring.)"""
    value = environ.get(ENV, "").strip()
    if value in ("", "0", "1"):
        return value == "1"
    raise ValueError(f"{ENV}: want 0 or 1, got {value!r}")


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
