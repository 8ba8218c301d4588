"""Holder notices from a real endpoint process: its peer server answers ``Await`` from
its own replicas (``Endpoint`` wires them in), and refuses once ``unpublish`` dropped
the version."""

from __future__ import annotations

import pytest

from tensorhub_cli.engines import wire

from .test_data_plane import hub  # noqa: F401 (a fixture)
from .test_hub_service import TOKEN, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


def test_a_publisher_answers_await_from_its_replica_until_it_unpublishes(hub):  # noqa: F811
    _, _, spawn = hub
    pub = spawn("pub", "tcp")
    chunks = pub.ask("publish", model="m", version=1, seed=3, mib=1, chunk_mib=0.25)["chunks"]
    address = pub.ask("peer")["address"]
    every = (1 << chunks) - 1
    assert wire.await_chunks(address, TOKEN, "m", 1, every, 10.0) == every
    with pytest.raises(wire.PeerError, match="not_found"):
        wire.await_chunks(address, TOKEN, "m", 2, 1, 10.0)
    assert "error" not in pub.ask("unpublish", model="m", version=1)
    with pytest.raises(wire.PeerError, match="not_found"):
        wire.await_chunks(address, TOKEN, "m", 1, 1, 10.0)
