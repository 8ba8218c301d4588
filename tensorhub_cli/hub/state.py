"""The hub's tables: what the concern modules read and change. Pure data, no I/O.

``HubState`` holds every table (endpoints, versions, group rounds, read loads, the
topology index, operators' withdrawals, counters, the event log) and the few accessors
every concern uses.
The operations live in one module per concern (``membership``, ``publishing``,
``resolving``, ``reading``, ``draining``, ``commands``, ``views``); ``machine.Hub``
is their one entry point. Time is never read here: every call is given ``now``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..planner import Asking, Place
from . import protocol as p
from .faults import Acked, Answered, HubFault, Send
from .groups import Round
from .registry import Version
from .retention import Policy

EVENTS_KEPT = 500


@dataclass
class HubConfig:
    cluster: str = "tensorhub"
    expiry_s: float = 5.0  # an endpoint not heard from for longer is dropped (contract 6)
    round_timeout_s: float = 120.0  # a group round ends after this long (contract 2)
    grace_s: float | None = None  # after start, no drain is judged complete; default: expiry_s
    planner: str = "ros"  # "ros", or "star": every read from a publisher (benchmark baseline)
    policies: dict[str, Policy] = field(default_factory=dict)
    default_policy: Policy = Policy()
    max_window: int = 1024
    # ROS planner: reads one source serves at once (all versions) once more than one
    # reader uses it. A source that splits its link over many readers finishes every
    # chunk late, and so delays the relaying that makes fan-out flat; readers it turns
    # away read from peers. A source with one reader is not capped: its window rules.
    # With k readers asking a publisher, each may hold cap // k of its reads (at least
    # one), so the reader whose report comes with its next plan cannot take every
    # freed read.
    max_reads_per_source: int = 4
    # Reads sent as deltas against an older version both ends hold (``hub.deltas``):
    # per model "off", "remote" (across DC links) or "all"; others get the default.
    deltas: dict[str, str] = field(default_factory=dict)
    default_deltas: str = "remote"
    # A new swarm's first readers that ask within this long are laid out together,
    # sorted by rack and node (``hub.mustering``); 0: every plan answered at once.
    muster_s: float = 0.0


@dataclass
class Withdrawal:
    """An operator's ``Withdraw`` of one version (every holder, or those on ``node``)
    in progress. It stays until none of its replicas is left, even once answered with a
    timeout: the drains it started go on, and retention must keep treating the version
    (or the node) as withdrawn until they end."""

    version: Version  # this very version: one published again later under its number is another
    node: str  # "": the whole version
    timeout_s: float
    deadline: float
    seen: set[str] = field(default_factory=set)  # every holder it targeted (the answer names them)
    answered: bool = False  # (timed out: the operator was told who still held it)

    def targets(self, name: str, endpoints: dict) -> bool:
        ep = endpoints.get(name)
        return not self.node or (ep is not None and ep.info.node == self.node)


def withdraw_key(model: str, version: int, node: str) -> tuple:
    """Who waits for a ``Withdraw``'s deferred answer: the service's waiter key."""
    return ("withdraw", model, version, node)


@dataclass
class Endpoint:
    info: p.EndpointInfo
    last_seen: float
    place: Place = field(init=False)
    bytes_planned: int = 0  # reads planned for it (as a reader), all versions
    bytes_from_publishers: int = 0  # of those, served by publishers

    def __post_init__(self) -> None:
        self.place = Place(node=self.info.node, rack=self.info.rack, dc=self.info.dc)

    @property
    def name(self) -> str:
        return self.info.name


class HubState:
    def __init__(self, config: HubConfig, now: float = 0.0):
        self.config = config
        self.started_at = now
        self.grace_until = now + (config.expiry_s if config.grace_s is None else config.grace_s)
        self.endpoints: dict[str, Endpoint] = {}
        self.models: dict[str, dict[int, Version]] = {}
        self.rounds: dict[tuple[str, str], Round] = {}
        self.load: dict[str, int] = {}  # reads in flight per source, all versions
        # Sources at max_reads_per_source: a plan skips them in C (set difference), not
        # one by one, so a reader whose rack is busy walks its DC in microseconds.
        self.full: set[str] = set()
        self.asking = Asking()  # which readers asked which source lately (fair shares)
        self.near: dict[tuple, set[str]] = {}  # topology group (node, rack, dc) -> endpoint names
        self.counters: dict[str, float] = {}
        self.events: deque[p.Event] = deque(maxlen=EVENTS_KEPT)
        self._event_seq = 0
        self._outbound: list[Acked | Send | Answered] = []
        self.withdrawals: dict[tuple, Withdrawal] = {}  # by withdraw_key
        # after a restart: rebuilt reads whose source has not re-registered yet
        self.unplaced: dict[str, list[tuple[Version, str, int]]] = {}  # source -> (version, reader, chunk)
        self.musters: dict[tuple, object] = {}  # (model, version, dc, want) -> ``mustering.Muster``

    def count(self, key: str, n: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def event(self, now: float, kind: str, endpoint: str = "", model: str = "", version: int = 0,
              message: str = "") -> None:
        """Append to the bounded event log that ``Status`` returns."""
        self._event_seq += 1
        self.events.append(p.Event(seq=self._event_seq, t=round(now - self.started_at, 3), kind=kind,
                                   endpoint=endpoint, model=model, version=version, message=message))

    def queue(self, item: Acked | Send | Answered) -> None:
        self._outbound.append(item)

    def take_outbound(self) -> list[Acked | Send | Answered]:
        """Acknowledgements and commands queued since the last call, for delivery."""
        out, self._outbound = self._outbound, []
        return out

    def policy(self, model: str) -> Policy:
        return self.config.policies.get(model, self.config.default_policy)

    def endpoint(self, name: str, incarnation: str = "") -> Endpoint:
        """The registered endpoint ``name``; an op that names an ``incarnation`` other
        than the registered one comes from a replaced process and is ``fenced``."""
        ep = self.endpoints.get(name)
        if ep is None:
            # After a hub restart every endpoint lands here once, and re-registers.
            raise HubFault("unknown_endpoint", f"endpoint {name!r} is not registered")
        if incarnation and ep.info.incarnation and incarnation != ep.info.incarnation:
            raise HubFault("fenced", f"endpoint {name!r} was replaced by another process (incarnation "
                                     f"{ep.info.incarnation[:8]}, not {incarnation[:8]}); this one must stop")
        return ep

    def version(self, model: str, number: int) -> Version:
        v = self.models.get(model, {}).get(number)
        if v is None:
            raise HubFault("not_found", f"{model}@{number} is not known to the hub")
        return v

    def alive(self, now: float, name: str) -> bool:
        ep = self.endpoints.get(name)
        return ep is not None and now - ep.last_seen <= self.config.expiry_s

    def reliable(self, name: str) -> bool:
        ep = self.endpoints.get(name)
        return ep is not None and ep.info.reliable

    def pin(self, v: Version, reader: str, source: str, chunks: int, relays: bool = True) -> None:
        """Reads in flight (``chunks``: a bitset): they hold ``source``'s drain back
        (contract 3) and count against its read slots (``relays``: see ``Version.pin``)."""
        v.pin(reader, source, chunks, relays)
        load = self.load[source] = self.load.get(source, 0) + chunks.bit_count()
        if load >= self.config.max_reads_per_source:
            self.full.add(source)

    def unpin(self, v: Version, reader: str, chunks: int) -> None:
        """Ends ``reader``'s reads of ``chunks`` (a bitset; -1: all of them)."""
        for source, n in v.unpin(reader, chunks).items():
            left = self.load[source] - n
            if left < self.config.max_reads_per_source:
                self.full.discard(source)
            if left:
                self.load[source] = left
            else:
                del self.load[source]
