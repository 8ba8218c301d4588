"""Two DCs on the testbed: for one version, the bytes that cross the DC link equal one
copy (contract 8), read from the kernel's counters on that link, not from our own
bookkeeping. n1, n2 are in dc1 (n1 publishes); n3, n4 in dc2 fetch at once. Version 2
is version 1 after a training-like step (2 % of the elements one bit off): the one copy
that crosses for it is deltas against version 1 (``hub.deltas``, the default across DC
links), a small share of a copy, and both readers still get exact bytes."""

from __future__ import annotations

import pytest

from tensorhub_cli.bench.testbed import enter, link_counters

from ..integration.peers import Worker
from .conftest import leftovers, th

pytestmark = pytest.mark.timeout(600)
MIB = 64
SIZE = MIB * 2**20


@pytest.mark.parametrize("built", [pytest.param((4, "--dcs", "2", "--racks", "2"), id="2-dcs")], indirect=True)
def test_one_copy_per_version_crosses_the_dc_link(built, tmp_path):
    state, home = built, tmp_path / "th_home"
    assert [row["link"] for row in state["check"]] == ["node", "duplex", "dc"]  # one rack per DC: no rack pair
    for row in state["check"]:
        assert 0.75 <= row["achieved_mbit"] / row["expect_mbit"] <= 1.05, row
    th("up", state["cluster_yaml"], "--timeout", "60", home=home)
    ws = {n: Worker("-", "-", f"w-{n}", extra=["--cluster", "testbed", "--node", n], prefix=enter(n),
                    env={"TH_HOME": str(home)}) for n in ("n1", "n3", "n4")}
    try:
        for w in ws.values():
            assert w.hello["ready"]
        crossed = []
        for version in (1, 2):
            step = {"seed": 1, "step": version - 1, "share": 0.02}
            ws["n1"].ask("publish", model="dc", version=version, mib=MIB, chunk_mib=4, timeout=120, **step)
            before = link_counters(state, "dc", "dc2")["tx_bytes"]
            for n in ("n3", "n4"):
                ws[n].send("fetch", model="dc", version=version, mib=MIB, timeout=180, **step)
            for n in ("n3", "n4"):
                reply = ws[n].recv(240)
                assert reply.get("equal") is True, (n, reply)
            crossed.append(link_counters(state, "dc", "dc2")["tx_bytes"] - before)
    finally:
        for w in ws.values():
            w.stop()
        th("down", "-c", "testbed", home=home, check=False)
    print(f"DC link carried {[round(c / SIZE, 4) for c in crossed]} copies per version")
    # One copy plus TCP/IP headers and control traffic (plans, heartbeats), never two.
    assert SIZE <= crossed[0] <= 1.08 * SIZE, f"{crossed[0] / SIZE:.3f} copies crossed the DC link"
    # Version 2: that one copy as deltas (about 1 % of it for these changes), not two.
    assert 0 < crossed[1] <= 0.25 * SIZE, f"version 2: {crossed[1] / SIZE:.3f} copies crossed the DC link"
    assert not [x for x in leftovers() if "tensorhub_cli" in x or "worker" in x]
