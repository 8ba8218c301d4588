"""Misuse of the endpoint API gets one clear error naming the argument, not a raw
ValueError, AttributeError or ZMQError from inside."""

from __future__ import annotations

import pytest
import torch

from tensorhub_cli.endpoint import EndpointError, FetchError, connect
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration


@pytest.fixture
def ep(token_file):
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    ep = connect(address, TOKEN, name="e", engine="tcp", heartbeat_s=0.2)
    ep.publish("m", 1, {"w": torch.ones(1024)})
    yield ep
    ep.close(drain_timeout=0)
    client.close()
    stop_child(proc)


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
