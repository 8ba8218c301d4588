"""A real hub process paused (SIGSTOP) for three times its expiry while its endpoints
go on beating: when it runs again it excuses the time it did not listen
(``HubService._listening``, ``Hub.excuse``), so nobody is expired and nobody has to
register again. Without the excuse every endpoint was expired, three runs in three."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tensorhub_cli.bench.rig import HubProcess
from tensorhub_cli.endpoint import connect
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.client import HubClient

pytestmark = pytest.mark.integration


def status(hub: HubProcess) -> p.StatusReply:
    client = HubClient(hub.address, hub.token)
    try:
        return client.call(p.Status(), timeout=5)
    finally:
        client.close()


def test_a_paused_hub_does_not_expire_the_endpoints_that_beat_while_it_slept():
    with HubProcess(expiry_s=1.0) as hub:
        eps = [connect(hub.address, hub.token, name=f"e{i}", engine="tcp", heartbeat_s=0.2) for i in range(3)]
        try:
            time.sleep(0.5)  # a few on-time sweeps first
            os.kill(hub.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(3 * hub.expiry_s)
            finally:
                os.kill(hub.proc.pid, signal.SIGCONT)
            time.sleep(4 * 0.2)  # four sweeps (expiry_s / 5) after the stall
            st = status(hub)
            assert sorted(e.name for e in st.endpoints if e.alive) == ["e0", "e1", "e2"]
            assert "expiries" not in st.counters, st.counters
            assert st.counters.get("stalls", 0) >= 1 and any(e.kind == "stalled" for e in st.events), st.counters
            assert [ep.service.registrations for ep in eps] == [1, 1, 1]
        finally:
            for ep in eps:
                ep.close(drain_timeout=0)
