"""Endpoint state shared between threads: the replica table (``Replicas``) is read under its lock."""

from __future__ import annotations

import threading

import torch

from tensorhub_cli.endpoint.endpoint import Endpoint
from tensorhub_cli.endpoint.replicas import Replicas
from tensorhub_cli.endpoint.zombies import Zombies
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.engines.tcp import TcpEngine
from tensorhub_cli.hub import protocol as p


class Guarded(dict):
    """A replica table that fails any walk over it made without the endpoint's lock."""

    def __init__(self, lock: threading.Lock):
        super().__init__()
        self.lock = lock

    def _check(self) -> None:
        assert self.lock.locked(), "walked the replica table without the endpoint's lock"

    def values(self):
        self._check()
        return super().values()

    def items(self):
        self._check()
        return super().items()

    def keys(self):
        self._check()
        return super().keys()

    def __iter__(self):
        self._check()
        return super().__iter__()


def bare_endpoint() -> Endpoint:
    """An endpoint with no hub and no threads: what publish touches, and a hub that says yes."""
    ep = Endpoint.__new__(Endpoint)
    ep.name, ep.incarnation, ep.chunk_bytes, ep.small_bytes = "e", "i1", 1 << 20, 1 << 10
    ep.info = p.EndpointInfo(name="e", node="n")
    ep.served = Regions()
    ep.engine = ep.tcp = TcpEngine("t")
    ep.replicas = Replicas(ep.name, ep.info.tier, ep.registrations, ep.served)
    ep.replicas._table = Guarded(ep.replicas._lock)  # (the table itself: what this test watches)
    ep.call = lambda op, timeout: p.Ok()
    ep.zombies = Zombies("e", "i1", lambda key: None, 1.0)
    return ep


def test_publish_walks_the_replicas_under_the_lock():
    ep = bare_endpoint()
    try:
        ep.publish("m", 1, {"w": torch.ones(1024)})
        ep.publish("m", 2, {"w": torch.ones(1024)})  # a walk over a table that holds one
        assert len(ep.replicas) == 2 and len(dict.keys(ep.replicas._table)) == 2
    finally:
        ep.tcp.close()
