"""One resolve for a model-parallel group: a member resolves (``Endpoint.resolve``), the
resolution travels to the others as a pickle (vLLM's workers broadcast it over their own
group, ``adapters.vllm``), and each member's fetch takes it as the version without
asking the hub to name it. Real hub process, in-process endpoints on the tcp engine."""

from __future__ import annotations

import pickle

import msgspec
import pytest
import torch

from tensorhub_cli.endpoint import BadArgument, TensorHubError, connect
from tensorhub_cli.hub import protocol as p

from .test_hub_service import TOKEN, hub, token_file  # noqa: F401 (fixtures)

pytestmark = pytest.mark.integration

KW = dict(engine="tcp", chunk_bytes=256 << 10, heartbeat_s=0.2)


def resolves(client) -> int:
    return int(client.call(p.Status()).counters.get("resolves", 0))


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 512, generator=g), "b": torch.randn(512, generator=g)}


def empty() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(512, 512), "b": torch.zeros(512)}


def test_members_fetch_one_resolution_with_one_resolve_at_the_hub_even_after_a_newer_version(hub):
    address, client, _ = hub
    with connect(address, TOKEN, name="pub", **KW) as pub, connect(address, TOKEN, name="m0", **KW) as m0, \
            connect(address, TOKEN, name="m1", **KW) as m1:
        pub.publish("m", 1, weights(1))
        before = resolves(client)
        shared = pickle.dumps(m0.resolve("m"))  # ("latest": v1)
        pub.publish("m", 2, weights(2))  # READY before any member fetches: contract 2 still holds v1
        got = {}
        for member in (m0, m1):
            into = empty()
            got[member.name] = member.fetch("m", pickle.loads(shared), into=into, timeout=30)
            assert all(torch.equal(into[k], weights(1)[k]) for k in into), member.name
            assert member.last_fetch["bytes"] > 0
        assert got == {"m0": 1, "m1": 1}
        assert resolves(client) == before + 1  # the members' fetches named no version at the hub
        into = empty()
        assert m1.fetch("m", "latest", into=into, timeout=30) == 2  # (a plain fetch resolves, as before)
        assert resolves(client) == before + 2


def test_a_resolution_of_another_model_or_without_manifests_is_refused_before_anything_changes(hub):
    address, client, _ = hub
    with connect(address, TOKEN, name="pub", **KW) as pub, connect(address, TOKEN, name="rd", **KW) as rd:
        pub.publish("m", 1, weights(1))
        r = rd.resolve("m", 1)
        with pytest.raises(BadArgument, match=r"version is a resolution of m@1, not of 'other'"):
            rd.fetch("other", r, into=empty(), timeout=10)
        with pytest.raises(BadArgument, match="without its manifests"):
            rd.fetch("m", msgspec.structs.replace(r, shards=[]), into=empty(), timeout=10)
        with pytest.raises(BadArgument, match="timeout"):
            rd.resolve("m", 1, timeout=0)
        assert rd.replicas.all() == []  # nothing registered, nothing held


def test_a_resolution_whose_version_was_unpublished_since_fails_the_fetch_and_leaves_nothing(hub):
    address, client, _ = hub
    with connect(address, TOKEN, name="pub", **KW) as pub, connect(address, TOKEN, name="rd", **KW) as rd:
        pub.publish("m", 1, weights(1))
        r = rd.resolve("m", 1)
        pub.unpublish("m", 1)  # the only holder: m@1 is gone
        with pytest.raises(TensorHubError, match="m@1"):
            rd.fetch("m", r, into=empty(), timeout=10)
        assert rd.replicas.all() == []
