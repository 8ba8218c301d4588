"""The hub's state machine: pure, no sockets, time injected.

Protocol: every operation is a method taking the current time ``now`` (seconds,
monotonic) and returning a reply body or raising ``HubFault``. ``expire(now)`` must be
called periodically; it removes endpoints silent for longer than ``expiry_s``.
Deferred answers (an unpublish waiting for its drain) and hub → agent commands are
queued as ``Outbound`` events, to be taken with ``take_outbound()`` after each call.
State is soft: it can be rebuilt entirely from endpoints re-registering what they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import protocol as p


class HubFault(Exception):
    """An operation refused; the state is unchanged."""

    def __init__(self, code: str, message: str, missing: list[int] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.missing = missing or []

    def as_error(self) -> p.Error:
        return p.Error(code=self.code, message=self.message, missing=self.missing)


@dataclass
class Endpoint:
    info: p.EndpointInfo
    last_seen: float
    registered_at: float

    @property
    def name(self) -> str:
        return self.info.name


@dataclass
class HubConfig:
    cluster: str = "tensorhub"
    expiry_s: float = 5.0


@dataclass
class Hub:
    config: HubConfig
    started_at: float = 0.0
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)

    def count(self, key: str, n: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # --- endpoints -------------------------------------------------------------------

    def register(self, now: float, op: p.Register) -> p.Ok:
        old = self.endpoints.get(op.info.name)
        if old is not None and old.info.pid != op.info.pid and now - old.last_seen < self.config.expiry_s:
            # A second live process under one name would corrupt every reference it owns.
            raise HubFault("conflict", f"endpoint name {op.info.name!r} is held by a live endpoint (pid {old.info.pid})")
        self.endpoints[op.info.name] = Endpoint(info=op.info, last_seen=now, registered_at=now)
        self.count("registrations")
        return p.Ok()

    def _endpoint(self, name: str) -> Endpoint:
        ep = self.endpoints.get(name)
        if ep is None:
            # After a hub restart every endpoint lands here once, and re-registers.
            raise HubFault("unknown_endpoint", f"endpoint {name!r} is not registered")
        return ep

    def heartbeat(self, now: float, op: p.Heartbeat) -> p.Ok:
        self._endpoint(op.name).last_seen = now
        return p.Ok()

    def deregister(self, now: float, op: p.Deregister) -> p.Ok:
        self._endpoint(op.name)
        self._drop_endpoint(op.name)
        return p.Ok()

    def expire(self, now: float) -> list[str]:
        dead = [n for n, ep in self.endpoints.items() if now - ep.last_seen > self.config.expiry_s]
        for name in dead:
            self._drop_endpoint(name)
            self.count("expiries")
        return dead

    def _drop_endpoint(self, name: str) -> None:
        del self.endpoints[name]

    # --- views -----------------------------------------------------------------------

    def status(self, now: float) -> p.StatusReply:
        eps = [
            p.EndpointStatus(
                name=ep.name,
                node=ep.info.node,
                role=ep.info.role,
                kind=ep.info.kind,
                alive=now - ep.last_seen <= self.config.expiry_s,
                heartbeat_age_s=round(now - ep.last_seen, 3),
                replicas=0,
            )
            for ep in sorted(self.endpoints.values(), key=lambda e: e.name)
        ]
        return p.StatusReply(
            cluster=self.config.cluster,
            uptime_s=round(now - self.started_at, 3),
            endpoints=eps,
            versions=[],
            counters=dict(self.counters),
        )
