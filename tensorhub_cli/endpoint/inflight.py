"""What a fetch has in flight, as typed records (the fetch loop's and the endpoint's).

A record is owned by the thread that made it (the fetch loop, on the caller's
thread); ``Zombie``s go to the endpoint, whose service thread reaps them (under the
endpoint's zombie lock).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ..engines import wire
from ..engines.base import Engine
from ..hub import protocol as p


@dataclass(slots=True)
class Reading:
    """A chunk read in flight."""

    source: str
    engine: Engine
    xfer: object  # the engine's transfer
    started: float  # monotonic


@dataclass(slots=True)
class Verifying:
    """A chunk that arrived, its checksum being computed on a verifier thread."""

    source: str
    digest: Future


@dataclass(slots=True)
class Holder:
    """A holder we read from: the engine that reads it and what it told us."""

    engine: Engine
    peer: object  # the engine's peer key
    described: wire.Described


@dataclass(slots=True)
class Asked:
    """The plan request awaiting its reply."""

    rid: int
    sent: float  # monotonic
    op: p.Plan
    registrations: int = 0  # the service's count when it was sent


@dataclass(slots=True)
class Stopping:
    """A read given up (timed out, re-planned) whose transfer was told to stop but may
    still write into the chunk's memory. It stays in flight for the hub (pinned on its
    source, contract 3) and its chunk is not read again until the engine confirms."""

    source: str
    engine: Engine
    xfer: object
    report: bool  # True: report it failed once stopped; False: the hub re-planned it already


@dataclass(slots=True)
class Zombie:
    """A transfer that could not be released yet; the endpoint retries later. ``read``
    set: one a failed fetch left pinned at the hub, reported once it stopped (for
    ``model@version``, whose ``world`` and ``shards`` a re-registration carries so a
    restarted hub pins it again: contract 3)."""

    engine: Engine
    xfer: object
    model: str = ""
    version: int = 0
    read: p.Read | None = None
    world: int = 0
    shards: tuple[p.Manifest, ...] = ()
