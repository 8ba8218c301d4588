"""Misuse of the endpoint API gets one clear error naming the argument, not a raw
ValueError, AttributeError or ZMQError from inside."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tensorhub_cli.endpoint import EndpointError, FetchError, connect
from tensorhub_cli.errors import HubError
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def hub_address(token_file):
    """The address of a hub of our own."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    yield address
    client.close()
    stop_child(proc)


@pytest.fixture
def ep(hub_address):
    ep = connect(hub_address, TOKEN, name="e", engine="tcp", heartbeat_s=0.2)
    ep.publish("m", 1, {"w": torch.ones(1024)})
    yield ep
    ep.close(drain_timeout=0)


@pytest.mark.parametrize("version, into, needle", [
    ("lates", {"w": torch.zeros(1024)}, "version"),
    (1, None, "into"),
    (1, [torch.zeros(1024)], "into"),
])
def test_a_bad_argument_is_one_clear_error_naming_it(ep, version, into, needle):
    with pytest.raises((EndpointError, FetchError)) as exc:
        ep.fetch("m", version, into=into, timeout=5)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_calls_after_close_say_the_endpoint_is_closed(ep):
    ep.close(drain_timeout=0)
    for call in (lambda: ep.fetch("m", 1, into={"w": torch.zeros(1024)}, timeout=5),
                 lambda: ep.publish("m", 2, {"w": torch.ones(8)}),
                 lambda: ep.unpublish("m", 1),
                 lambda: ep.versions("m")):
        with pytest.raises(EndpointError, match="closed"):
            call()


def test_a_publish_the_hub_would_not_keep_is_one_line_naming_what_it_holds(hub_address, ep):
    """Scenario 11: the hub keeps 2 versions (keep_latest's default); m@1 once 2 and 3
    are READY would vanish at once, and readers would wait for it."""
    ep.publish("m", 2, {"w": torch.full((1024,), 2.0)})
    ep.publish("m", 3, {"w": torch.full((1024,), 3.0)})
    other = connect(hub_address, TOKEN, name="e2", engine="tcp", heartbeat_s=0.2)
    try:
        with pytest.raises(HubError) as exc:
            other.publish("m", 1, {"w": torch.zeros(1024)})
        assert exc.value.code == "stale" and "\n" not in str(exc.value)
        assert "m@3, 2" in str(exc.value) and "publish m@4 or later" in str(exc.value)
        with pytest.raises(HubError) as exc:  # the same number, other bytes
            other.publish("m", 3, {"w": torch.zeros(1024)})
        assert exc.value.code == "conflict" and "th unpublish m 3" in str(exc.value)
        assert not other.replicas, "a refused publish leaves its tensors registered"
        other.publish("m", 4, {"w": torch.zeros(1024)})
        assert [v.version for v in other.versions("m")] == [3, 4]
    finally:
        other.close(drain_timeout=0)


def test_a_bad_token_fails_connect_at_once_in_one_line(hub_address, ep, caplog):
    """Scenario 12: a wrong token never succeeds: no 10 s of retries, no generic error."""
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="tensorhub"), pytest.raises(HubError) as exc:
        connect(hub_address, "x" * 32, name="intruder", engine="tcp", heartbeat_s=0.2, connect_timeout=10.0)
    took = time.monotonic() - started
    assert took < 3.0, f"connect with a bad token took {took:.1f}s"
    assert exc.value.code == "auth" and "bad cluster token" in str(exc.value) and "\n" not in str(exc.value)
    lines = [r for r in caplog.records if r.name.startswith("tensorhub")]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
