"""Group transactions (contract 2): one version per group per round.

A round opens when a member of a group resolves ``latest`` and no round is open; it
fixes the version every member resolving ``latest`` gets until the round ends. It ends
when (a) every member has loaded the round's version (a complete replica, or, for a
reader of another layout such as a TP shard, every piece its boxes need) and the member
asking resolved in the round already (it starts its next update; a member that has
not taken the round's version yet gets it, even when it already holds it, or a
no-op update by one member would end the round and a version landing next would
split the group), or (b) a member
that resolved in it is gone (expired or deregistered), or (c) ``timeout_s`` passed
since it opened. Members are the endpoints registered with that group name, plus any
endpoint that resolved in the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Round:
    number: int
    version: int
    opened_at: float
    resolved: set[str] = field(default_factory=set)


def round_over(rnd: Round, members: set[str], now: float, timeout_s: float,
               registered: Callable[[str], bool], complete: Callable[[str], bool], asking: str) -> str | None:
    """Why the round is over for ``asking``'s resolve, or None while it is open."""
    if now - rnd.opened_at >= timeout_s:
        return "timeout"
    if any(not registered(m) for m in rnd.resolved):
        return "member gone"
    if asking in rnd.resolved and all(complete(m) for m in members | rnd.resolved):
        return "all done"
    return None
