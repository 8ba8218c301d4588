"""Find NIXL's Python API whichever backend wheel provides it.

The `nixl` meta-package exposes ``nixl._api``; the backend wheels expose
``nixl_cu13._api`` / ``nixl_cu12._api``. We depend on one backend wheel only, so we
look for each in turn. ``TH_NIXL_MODULE`` (e.g. ``nixl_cu12``) picks one explicitly,
for nodes that have more than one installed.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType

CANDIDATES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


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


def load_nixl() -> ModuleType:
    wanted = os.environ.get("TH_NIXL_MODULE")
    candidates = (f"{wanted.removesuffix('._api')}._api",) if wanted else CANDIDATES
    # UCX's InfiniBand module crashes (SIGSEGV) on hosts without IB devices; users with
    # IB hardware set UCX_MODULES themselves.
    os.environ.setdefault("UCX_MODULES", "^ib")
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
