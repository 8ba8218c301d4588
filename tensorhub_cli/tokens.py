"""The cluster token on disk: always replaced whole, never read empty.

Protocol. Every process of a cluster (hub, agents, runners, supervisors) reads the
token from a file named by ``--token-file``; ``th up`` writes that file on each node,
and on a node that runs both the hub and an agent it writes it once per process it
starts. A writer therefore never truncates the file in place: ``write_token_file``
writes a sibling temporary file (mode 0600) and renames it over the name, so a
process that opens the file at any moment reads either the old token or the new one,
whole. ``token_shell`` is the same step as a remote shell line (the SSH launcher's).
A truncate-then-write once let a hub starting beside its agent read an empty token;
it then refused every endpoint as "bad cluster token".

``read_token_file`` returns the stripped token or raises ``BadArgument`` naming the
file: missing, unreadable and empty are all refused at start, because a process
holding a wrong token can only fail later, at every call, with a less clear message.
Standard library only.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from .errors import BadArgument


def write_token_file(path: str | os.PathLike, token: str) -> Path:
    """Replace ``path`` with ``token`` (0600) by rename; once this returns, every
    later open of ``path`` reads ``token``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def token_shell(directory: str) -> str:
    """A shell line that stores its stdin as ``DIRECTORY/token`` by the same rename
    (``$$``: the remote shell's PID keeps concurrent writers' temporaries apart)."""
    d = shlex.quote(directory)
    return (f"mkdir -p {d} && umask 077 && cat > {d}/.token.$$.tmp && mv -f {d}/.token.$$.tmp {d}/token"
            f" || {{ rm -f {d}/.token.$$.tmp; exit 1; }}")


def read_token_file(path: str | os.PathLike) -> str:
    """The token in ``path``, stripped; ``BadArgument`` naming the file if it is
    missing, unreadable or empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadArgument(f"--token-file {path}: cannot read the cluster token: {exc}") from None
    if not token:
        raise BadArgument(f"--token-file {path}: the file is empty; it must hold the cluster token")
    return token
