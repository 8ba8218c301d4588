"""Topology levels: how far a source is from a reader (contract 8's cost order).

Levels: 0 same node, 1 same rack, 2 same DC, 3 (``REMOTE``) another DC. A place
belongs to three nested groups (node ⊂ rack ⊂ DC); the hub indexes endpoints and
holders by these groups, so a plan walks the holders near its reader, level by level,
instead of every endpoint of the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("node", "rack", "dc", "remote")
REMOTE = 3


@dataclass(frozen=True)
class Place:
    node: str
    rack: str
    dc: str


def groups(place: Place) -> tuple[tuple, ...]:
    """The topology groups a place belongs to, narrowest first: node ⊂ rack ⊂ DC. A
    source's level for a reader is the index of the narrowest group they share (3, or
    REMOTE, if none)."""
    return ("node", place.dc, place.rack, place.node), ("rack", place.dc, place.rack), ("dc", place.dc)


def level_between(a: Place, b: Place) -> int:
    """The level of a source at ``b`` for a reader at ``a``: the narrowest group both
    belong to (``groups``), REMOTE if none."""
    return next((n for n, (x, y) in enumerate(zip(groups(a), groups(b))) if x == y), REMOTE)


def join(index: dict[tuple, set[str]], place: Place, name: str) -> None:
    """Add ``name`` to each topology group of ``place`` in ``index``."""
    for key in groups(place):
        index.setdefault(key, set()).add(name)


def leave(index: dict[tuple, set[str]], place: Place, name: str) -> None:
    """Remove ``name`` from each group of ``place``; empty groups are dropped."""
    for key in groups(place):
        members = index.get(key)
        if members is not None:
            members.discard(name)
            if not members:
                del index[key]
