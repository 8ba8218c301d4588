"""Hub commands on an endpoint: the default handler (``th sync`` into accepted memory),
the agent's, and the service worker that runs whichever handler the endpoint got."""

from __future__ import annotations

import pytest
import torch

from tensorhub_cli.agent.commands import AgentCommands
from tensorhub_cli.endpoint.commands import SyncCommands
from tensorhub_cli.endpoint.service import Service
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.layout import lay_out


class FakeEndpoint:
    """What a handler may use of an endpoint, recorded."""

    name = "ep"

    def __init__(self):
        self.sync_into: dict = {}
        self.reports: list[tuple[str, str]] = []
        self.fetched: list[tuple[str, int, dict, float]] = []
        self.published: list[tuple[str, int, dict, int | None, float]] = []
        self.discarded: list[tuple[str, int]] = []
        self.last_fetch = {"bytes": 0}
        self.manifest, _ = lay_out({"w": torch.arange(8, dtype=torch.float32)})

    def fetch(self, model, version, *, into, timeout):
        if callable(into):
            into = into([self.manifest])
        self.fetched.append((model, version, into, timeout))
        self.last_fetch = {"bytes": 32}
        return version

    def publish(self, model, version, state_dict, *, chunk_bytes, timeout):
        self.published.append((model, version, state_dict, chunk_bytes, timeout))

    def discard(self, model, version):
        self.discarded.append((model, version))

    def report(self, cmd, kind, message="", *, timeout=None):
        self.reports.append((kind, message))


def command(action: str, **kw) -> p.Command:
    return p.Command(action=action, model="policy", version=3, **kw)


def test_sync_fetches_into_what_accept_sync_named_and_reports_the_bytes():
    ep, into = FakeEndpoint(), {"w": torch.zeros(8)}
    ep.sync_into["policy"] = into
    SyncCommands(fetch_timeout=7.0)(ep, command("fetch"))
    assert ep.fetched == [("policy", 3, into, 7.0)]
    assert ep.reports == [("fetched", "32 bytes")]


def test_an_endpoint_that_accepts_no_sync_reports_the_fetch_failed():
    ep = FakeEndpoint()
    SyncCommands()(ep, command("fetch"))
    assert not ep.fetched
    assert ep.reports == [("fetch_failed", "EndpointError: ep accepts no sync of 'policy' (no accept_sync)")]


def test_discard_drops_the_replica_without_a_report_and_agents_commands_are_refused():
    ep = FakeEndpoint()
    handler = SyncCommands()
    handler(ep, command("discard"))
    handler(ep, command("retain"))
    assert ep.discarded == [("policy", 3)]
    assert [kind for kind, _ in ep.reports] == ["retain_failed"]


def test_the_agent_retains_into_fresh_host_memory_shaped_by_the_manifest():
    ep = FakeEndpoint()
    AgentCommands(fetch_timeout=9.0)(ep, command("retain"))
    (model, version, into, timeout), = ep.fetched
    assert (model, version, timeout) == ("policy", 3, 9.0)
    assert list(into) == ["w"] and into["w"].shape == (8,) and into["w"].dtype == torch.float32
    assert ep.reports == [("retained", "32 bytes")]


def test_the_agent_loads_a_safetensors_file_and_publishes_it(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "ckpt.safetensors"
    save_file({"w": torch.ones(4)}, str(path))
    ep = FakeEndpoint()
    AgentCommands(publish_timeout=4.0)(ep, command("load", path=str(path), chunk_bytes=1024))
    (model, version, sd, chunk_bytes, timeout), = ep.published
    assert (model, version, chunk_bytes, timeout) == ("policy", 3, 1024, 4.0) and torch.equal(sd["w"], torch.ones(4))
    assert ep.reports == [("loaded", str(path))]
    AgentCommands()(ep, command("load", path=str(tmp_path / "missing.safetensors")))
    assert ep.reports[-1][0] == "load_failed"


def test_the_service_worker_runs_the_endpoints_handler_and_survives_its_exceptions():
    seen = []

    def handler(ep, cmd):
        seen.append(cmd.action)
        if cmd.action == "retain":
            raise RuntimeError("boom")

    class Ep:
        name = "ep"

    service = Service(Ep(), client=None, heartbeat_s=1.0, handler=handler)
    for action in ("retain", "fetch"):
        service.commands.put(command(action))
    service.commands.put(None)
    service._work()  # on this thread: returns at the None
    assert seen == ["retain", "fetch"]


@pytest.mark.parametrize("action", ["fetch", "retain", "load"])
def test_a_report_goes_out_for_every_command_but_discard(action):
    ep = FakeEndpoint()
    AgentCommands()(ep, command(action, path="/nonexistent"))
    assert len(ep.reports) == 1
