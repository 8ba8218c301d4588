"""Builders for driving the pure hub in tests."""

from __future__ import annotations

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.retention import Policy
from tensorhub_cli.hub.machine import Acked, Hub, HubConfig, Send

EXPIRY = 5.0


def manifest(nchunks: int, chunk_bytes: int = 1024, salt: int = 0) -> p.Manifest:
    # Shards of one version hold different tensors (the hub checks each is covered once):
    # a salt names another shard's.
    tensors = [p.TensorMeta(name=f"w{i}" if not salt else f"s{salt}.w{i}", dtype="float32", shape=[chunk_bytes // 4], nbytes=chunk_bytes,
                            offset=i * chunk_bytes) for i in range(nchunks)]
    chunks = [p.ChunkMeta(nbytes=chunk_bytes, checksum=salt * 1000 + i) for i in range(nchunks)]
    return p.Manifest(tensors=tensors, chunks=chunks, chunk_bytes=chunk_bytes)


def info(name, node="n1", rack="r1", dc="dc1", kind="endpoint", reliable=True, group=None, pid=1, tier="host"):
    return p.EndpointInfo(name=name, node=node, rack=rack, dc=dc, kind=kind, reliable=reliable, group=group,
                          pid=pid, tier=tier, role=kind)


def new_hub(now=0.0, grace_s=0.0, policies=None, **kw) -> Hub:
    cfg = HubConfig(expiry_s=EXPIRY, grace_s=grace_s, policies=policies or {}, default_policy=Policy(2, 0), **kw)
    return Hub(cfg, now=now)


def reg(hub: Hub, now, *infos, holdings=None):
    for i in infos:
        hub.register(now, p.Register(info=i, holdings=holdings or []))


def acks(events) -> list[Acked]:
    return [e for e in events if isinstance(e, Acked)]


def sends(events, action: str | None = "retain") -> list[Send]:
    return [e for e in events if isinstance(e, Send) and action in (None, e.body.action)]


def fetch_all(hub: Hub, now, reader: str, model: str, version: int, window: int = 1024) -> int:
    """Plan and report until the reader is complete; returns plan rounds used."""
    for rounds in range(1, 100):
        plan = hub.plan(now, p.Plan(name=reader, model=model, version=version, window=window))
        if plan.complete:
            return rounds
        assert plan.reads, f"{reader} got no reads and is not complete (waiting={plan.waiting})"
        hub.progress(now, p.Progress(name=reader, model=model, version=version, chunks=[r.chunk for r in plan.reads]))
    raise AssertionError("fetch did not finish")
