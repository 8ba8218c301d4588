"""A 4-node testbed in 2 racks, `th up` over real SSH, data over the shaped links.

Contracts on real links: every byte equal after a fan-out fetch that crossed the
nodes' links (kernel counters, not our bookkeeping); a node whose link goes down
mid-fetch is expired within the heartbeat timeout and the fetch completes from the
other holders (contract 6); ssh failures are named per node and leave nothing behind.
"""

from __future__ import annotations

import subprocess
import time

import pytest
import yaml

from tensorhub_cli.bench.testbed import enter, node_counters
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient
from tensorhub_cli.spec.model import EndpointsSpec

from ..integration.peers import Worker, wait_until
from .conftest import leftovers, status, th

pytestmark = pytest.mark.timeout(600)
MIB = 128
SIZE = MIB * 2**20
built_params = [pytest.param((4, "--racks", "2"), id="4-nodes-2-racks")]


@pytest.fixture(scope="module")
def cluster(built, tmp_path_factory):
    home = tmp_path_factory.mktemp("th_home")
    up = th("up", built["cluster_yaml"], "--timeout", "60", home=home)
    assert "4 agents registered" in up.stdout
    yield built, home
    th("down", "-c", "testbed", home=home, check=False)


def workers(state, home, names: list[str]) -> dict[str, Worker]:
    ws = {n: Worker("-", "-", f"w-{n}", extra=["--cluster", "testbed", "--node", n], prefix=enter(n),
                    env={"TH_HOME": str(home)}) for n in names}
    for w in ws.values():
        assert w.hello["ready"]
    return ws


@pytest.mark.parametrize("built", built_params, indirect=True)
def test_check_transfers_show_the_links_are_shaped(built):
    rates = {row["link"]: row for row in built["check"]}
    assert set(rates) == {"node", "duplex", "rack"}
    for row in rates.values():
        assert 0.75 <= row["achieved_mbit"] / row["expect_mbit"] <= 1.05, row


@pytest.mark.parametrize("built", built_params, indirect=True)
def test_status_shows_every_node_with_its_rack_over_ssh(cluster):
    state, home = cluster
    doc = status(home, "testbed")
    agents = {p["node"]: p for p in doc["processes"] if p["role"] == "agent"}
    assert {n: (a["rack"], a["dc"], a["running"]) for n, a in agents.items()} == {
        "n1": ("rack1", "dc1", True), "n2": ("rack1", "dc1", True),
        "n3": ("rack2", "dc1", True), "n4": ("rack2", "dc1", True)}
    alive = {e["node"]: e["alive"] for e in doc["status"]["endpoints"] if e["kind"] == "agent"}
    assert alive == {"n1": True, "n2": True, "n3": True, "n4": True}
    log = th("logs", "n3", "-c", "testbed", "-n", "5", home=home).stdout
    assert "agent-n3: " in log and "registered agent-n3" in log


@pytest.mark.parametrize("built", built_params, indirect=True)
def test_publish_on_n1_fetch_on_three_nodes_over_the_links(cluster):
    state, home = cluster
    ws = workers(state, home, ["n1", "n2", "n3", "n4"])
    try:
        ws["n1"].ask("publish", model="fan", version=1, seed=11, mib=MIB, chunk_mib=4, timeout=120)
        before = {n: node_counters(state, n) for n in ws}
        for n in ("n2", "n3", "n4"):
            ws[n].send("fetch", model="fan", version=1, seed=11, mib=MIB, timeout=180)
        results = {n: ws[n].recv(240) for n in ("n2", "n3", "n4")}
        after = {n: node_counters(state, n) for n in ws}
    finally:
        for w in ws.values():
            w.stop()
    for n, r in results.items():
        assert r.get("equal") is True, (n, r)
        # The bytes came in over this node's veth: nothing took a loopback or shared-memory path.
        assert after[n]["rx_bytes"] - before[n]["rx_bytes"] >= SIZE, n
    sent = {n: after[n]["tx_bytes"] - before[n]["tx_bytes"] for n in ws}
    assert sent["n1"] < 3 * SIZE * 0.98, "readers relayed nothing: the publisher sent every copy"
    assert sum(sent.values()) >= 3 * SIZE


@pytest.mark.parametrize("built", built_params, indirect=True)
def test_a_node_whose_link_goes_down_mid_fetch_is_masked(cluster):
    """Contract 6 on a real link: nothing fails on a link that is down (no RST, no FIN),
    so only the hub's expiry of n2 can tell its readers in time; they re-plan then,
    not at their own read timeout."""
    state, home = cluster
    spec = yaml.safe_load(open(state["cluster_yaml"]))
    expiry = spec["hub"]["expiry_s"]
    read_timeout = (spec.get("endpoints") or {}).get("read_timeout_s", EndpointsSpec().read_timeout_s)
    ws = workers(state, home, ["n1", "n2", "n3", "n4"])
    n2 = next(n for n in state["nodes"] if n["name"] == "n2")
    try:
        ws["n1"].ask("publish", model="mask", version=1, seed=5, mib=MIB, chunk_mib=4, timeout=120)
        assert ws["n2"].ask("fetch", model="mask", version=1, seed=5, mib=MIB, timeout=180)["equal"]
        served = node_counters(state, "n2")["tx_bytes"]
        for n in ("n3", "n4"):
            ws[n].send("fetch", model="mask", version=1, seed=5, mib=MIB, timeout=180)
        # Mid-fetch (128 MiB takes > 2 s at the node rate): cut n2 off while it serves.
        wait_until(lambda: node_counters(state, "n2")["tx_bytes"] - served > 8 * 2**20, timeout=30,
                 what="n2 to serve the readers", every=0.05)
        subprocess.run(["ip", "-n", n2["ns"], "link", "set", "dev", "eth0", "down"], check=True, timeout=10)
        cut = time.monotonic()

        hub = HubClient(f"tcp://{state['nodes'][0]['address']}:7700", (home / "testbed" / "token").read_text())

        def n2_dead():  # expired endpoints are dropped; a silent one shows alive=False first
            return all(not e.alive for e in hub.call(p.Status(), timeout=2.0).endpoints if e.node == "n2")

        try:
            wait_until(n2_dead, timeout=expiry + 5, what="the hub to mark n2's endpoints dead")
        finally:
            hub.close()
        assert time.monotonic() - cut <= expiry + 3.0, "n2 stayed alive past the heartbeat timeout"
        results = {n: ws[n].recv(240) for n in ("n3", "n4")}
        for n, r in results.items():
            assert r.get("equal") is True, (n, r)
        # (each reader has at most 256 MiB left on n1's 500 Mbit/s link: about 4 s)
        assert time.monotonic() - cut < read_timeout, "the readers re-planned at their read timeout, " \
            "not when the hub expired n2"
    finally:
        subprocess.run(["ip", "-n", n2["ns"], "link", "set", "dev", "eth0", "up"], timeout=10)
        for w in ws.values():
            w.stop()


@pytest.mark.parametrize("built", built_params, indirect=True)
def test_ssh_failures_are_named_per_node_and_nothing_starts(built, tmp_path):
    spec = yaml.safe_load(open(built["cluster_yaml"]))
    spec["name"] = "broken"
    cases = {
        "unknown host key": ({"known_hosts": str(tmp_path / "empty_known_hosts")}, "ssh-keyscan"),
        "authentication failed": ({"key_file": str(tmp_path / "other_key")}, "authentication failed"),
    }
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other_key")], check=True)
    (tmp_path / "empty_known_hosts").write_text("")
    home = tmp_path / "home"
    for what, (override, hint) in cases.items():
        doc = {**spec, "ssh": {**spec["ssh"], **override}}
        path = tmp_path / f"{what.replace(' ', '_')}.yaml"
        path.write_text(yaml.safe_dump(doc))
        done = th("up", str(path), home=home, check=False, timeout=60)
        assert done.returncode == 1, done
        for node in ("n1", "n2", "n3", "n4"):
            assert f"{node} (root@" in done.stderr and what in done.stderr, done.stderr
        assert hint in done.stderr
    gone = {**spec, "ssh": {**spec["ssh"], "connect_timeout_s": 2}}
    gone["topology"]["datacenters"][0]["racks"][1]["nodes"][0]["address"] = "10.77.9.9"  # nobody there
    path = tmp_path / "unreachable.yaml"
    path.write_text(yaml.safe_dump(gone))
    done = th("up", str(path), home=home, check=False, timeout=60)
    assert done.returncode == 1 and "n3 (root@10.77.9.9:22): unreachable" in done.stderr, done.stderr
    assert "n1 (" not in done.stderr  # only the node at fault is named
    assert not (home / "broken" / "state.json").exists()


@pytest.mark.parametrize("built", built_params, indirect=True)
def test_th_down_then_testbed_down_leave_nothing(cluster):
    state, home = cluster
    down = th("down", "-c", "testbed", home=home)
    assert down.stdout.count("stopped") == 5  # 4 agents and the hub, each by its PID over ssh
    remote = subprocess.run(enter("n2") + ["pgrep", "-f", "tensorhub_cli"], capture_output=True, text=True,
                            timeout=20)
    assert remote.stdout.strip() == "", remote.stdout
    subprocess.run(["scripts/testbed", "down"], check=True, capture_output=True, timeout=120)
    assert leftovers() == []
