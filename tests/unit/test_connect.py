"""``connect(cluster=...)``: the cluster lookup (launch.lookup) feeds the endpoint's
explicit-address connect; what the caller passes wins where it may."""

from __future__ import annotations

import shutil

import pytest
import yaml

import tensorhub_cli
from tensorhub_cli.endpoint import EndpointError
from tensorhub_cli.launch.lookup import ClusterLookupError, endpoint_options
from tensorhub_cli.launch.state import ClusterState, cluster_dir, write_state, write_token


@pytest.fixture
def running(th_home, local_spec):
    """The on-disk state ``th up`` leaves, without any process."""
    doc = yaml.safe_load(local_spec.read_text())
    doc["endpoints"] = {"read_timeout_s": 12.0, "plan_timeout_s": 2.5, "drain_timeout_s": 40.0}
    local_spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    name = doc["name"]
    cluster_dir(name).mkdir(parents=True)
    shutil.copyfile(local_spec, cluster_dir(name) / "spec.yaml")
    write_token(name, "tok" * 11)
    write_state(ClusterState(cluster=name, launcher="local", hub_address="tcp://127.0.0.1:7", hub_node_address="",
                             metrics_port=None, heartbeat_s=0.2, expiry_s=1.0))
    return name, doc


def test_lookup_places_the_endpoint_and_passes_the_spec_timeouts(running):
    name, doc = running
    node2 = doc["topology"]["datacenters"][0]["racks"][0]["nodes"][1]
    assert endpoint_options(name, "node2") == dict(
        hub="tcp://127.0.0.1:7", token="tok" * 11, host=node2["address"], dc="dc1", rack="rack1", engine="nixl",
        heartbeat_s=0.2, read_timeout_s=12.0, plan_timeout_s=2.5, drain_timeout_s=40.0)


def test_lookup_says_what_is_missing(th_home, running):
    name, _ = running
    with pytest.raises(ClusterLookupError, match="is not running"):
        endpoint_options("nope", "node1")
    with pytest.raises(ClusterLookupError, match="needs node="):
        endpoint_options(name, None)
    with pytest.raises(ClusterLookupError, match="'node9' is not in cluster"):
        endpoint_options(name, "node9")


def test_connect_by_cluster_lets_the_caller_choose_timeouts_but_not_the_place(running, monkeypatch):
    name, _ = running
    got = {}
    monkeypatch.setattr("tensorhub_cli.endpoint.connect", lambda *a, **kw: got.update(args=a, **kw) or "ep")
    assert tensorhub_cli.connect(cluster=name, name="r", node="node2", host="10.9.9.9", engine="tcp",
                                 read_timeout_s=3.0, role="rollout") == "ep"
    assert got["args"] == () and got["hub"] == "tcp://127.0.0.1:7" and got["host"].startswith("127.0.")
    assert (got["engine"], got["read_timeout_s"], got["plan_timeout_s"], got["heartbeat_s"]) == ("tcp", 3.0, 2.5, 0.2)
    assert (got["name"], got["node"], got["role"]) == ("r", "node2", "rollout")


def test_connect_needs_exactly_one_way_to_the_hub_and_names_a_lookup_failure(th_home):
    with pytest.raises(EndpointError, match="exactly one of hub"):
        tensorhub_cli.connect(name="x")
    with pytest.raises(EndpointError, match="is not running"):
        tensorhub_cli.connect(cluster="nope", name="x", node="node1")
    with pytest.raises(EndpointError, match="needs token"):
        tensorhub_cli.connect(hub="tcp://127.0.0.1:1", name="x")


def test_connect_has_a_real_signature_and_documents_every_parameter():
    import inspect

    import tensorhub_cli.endpoint

    for fn in (tensorhub_cli.connect, tensorhub_cli.endpoint.connect):
        params = inspect.signature(fn).parameters
        assert not any(p.kind is p.VAR_KEYWORD for p in params.values()), f"{fn.__module__}.connect takes **options"
    doc = inspect.getdoc(tensorhub_cli.connect)
    missing = [name for name in inspect.signature(tensorhub_cli.connect).parameters if f"{name}:" not in doc
               and f"{name}," not in doc]
    assert not missing, f"help(tensorhub_cli.connect) does not describe {missing}"


def test_connect_by_cluster_passes_only_what_the_caller_gave(running, monkeypatch):
    name, _ = running
    got = {}
    monkeypatch.setattr("tensorhub_cli.endpoint.connect", lambda *a, **kw: got.update(kw) or "ep")
    tensorhub_cli.connect(cluster=name, name="r", node="node2", call_timeout_s=2.0)
    assert got["call_timeout_s"] == 2.0 and "connect_timeout" not in got and "on_command" not in got
    assert got["read_timeout_s"] == 12.0  # the cluster's, as the caller gave none


@pytest.fixture
def metrics_off(monkeypatch):
    """No /metrics listener of this process before or after the test."""
    from tensorhub_cli.endpoint import metrics

    monkeypatch.delenv("TH_METRICS_PORT", raising=False)
    monkeypatch.setattr(metrics, "_served", [])
    monkeypatch.setattr("tensorhub_cli.endpoint.connect", lambda *a, **kw: "ep")
    yield metrics
    metrics.shutdown()


def reachable(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_endpoint_metrics_bind_the_endpoints_address_not_every_interface(metrics_off):
    tensorhub_cli.connect(hub="tcp://127.0.0.1:7", token="tok" * 11, name="r", host="127.0.0.2", metrics_port=0)
    port = metrics_off.serve(0, "127.0.0.2")  # (the one listener's port)
    assert reachable("127.0.0.2", port)
    assert not reachable("127.0.0.3", port), "/metrics answers on an address the endpoint was not given (0.0.0.0)"


def test_endpoint_metrics_of_a_cluster_endpoint_bind_its_nodes_address(running, metrics_off, monkeypatch):
    name, doc = running
    node2 = doc["topology"]["datacenters"][0]["racks"][0]["nodes"][1]["address"]
    monkeypatch.setenv("TH_METRICS_PORT", "0")
    tensorhub_cli.connect(cluster=name, name="r", node="node2")
    port = metrics_off.serve(0, node2)
    assert reachable(node2, port) and not reachable("127.0.0.1" if node2 != "127.0.0.1" else "127.0.0.2", port)


def test_endpoint_metrics_are_opt_in(metrics_off):
    tensorhub_cli.connect(hub="tcp://127.0.0.1:7", token="tok" * 11, name="r", host="127.0.0.2")
    assert metrics_off._served == []


def test_connect_takes_the_fetch_protocol_and_refuses_a_bad_one(monkeypatch):
    from tensorhub_cli import BadArgument, endpoint as endpoint_lib

    made = {}
    monkeypatch.setattr(endpoint_lib, "Endpoint", lambda hub, token, info, **kw: made.update(kw) or "ep")
    assert tensorhub_cli.connect(hub="tcp://127.0.0.1:1", token="t", name="a", schedule=False) == "ep"
    assert made["schedule"] is False
    with pytest.raises(BadArgument, match="schedule"):
        tensorhub_cli.connect(hub="tcp://127.0.0.1:1", token="t", name="a", schedule="yes")
