"""A real hub process flooded with slow plans while an endpoint beats on time: the
beats are answered ahead of the queued plans (``HubService.take``), so the endpoint
is never expired however long the queue (contract 6). The plans are made slow by a
sleep in ``Hub.plan`` (the hub process is otherwise the real one), so the flood costs
no CPU on a shared machine.

Why many flooding sockets: zmq's ROUTER takes one message from each peer in turn, so a
beat waits for one op of every peer with a request queued. With 1,000 peers at 2 ms a
plan a beat used to wait 2 s, four times the expiry, and the sweeps (between batches of
256 ops, every 0.5 to 1 s) expired the endpoint."""

from __future__ import annotations

import sys
import time

import pytest
import zmq

from tensorhub_cli.bench.rig import HubProcess, free_port
from tensorhub_cli.endpoint import connect
from tensorhub_cli.hub import protocol as p
from tensorhub_cli.errors import HubError
from tensorhub_cli.hub.client import HubClient

pytestmark = pytest.mark.integration

PLAN_S = 0.002
PEERS, EACH = 1000, 3  # 3,000 plans: 6 s of hub work; one round of the peers: 2 s
EXPIRY_S, BEAT_S = 0.5, 0.1

# The real hub's entry point, with every Plan PLAN_S slower. HubProcess runs
# ``PREFIX python -m tensorhub_cli.hub ARGS``: this program drops the three words after
# it and passes ARGS on.
SLOW = (f"import sys, time\n"
        f"from tensorhub_cli.hub.machine import Hub\n"
        f"from tensorhub_cli.hub.__main__ import main\n"
        f"plan = Hub.plan\n"
        f"def slow(self, now, op):\n"
        f"    time.sleep({PLAN_S})\n"
        f"    return plan(self, now, op)\n"
        f"Hub.plan = slow\n"
        f"assert sys.argv[2:4] == ['-m', 'tensorhub_cli.hub'], sys.argv\n"
        f"sys.exit(main(sys.argv[4:]))\n")


def status(hub: HubProcess, timeout: float) -> p.StatusReply:
    client = HubClient(hub.address, hub.token)
    try:
        return client.call(p.Status(), timeout=timeout)
    finally:
        client.close()


def test_an_endpoint_that_beats_is_not_expired_by_a_long_queue_of_plans():
    hub = HubProcess(expiry_s=EXPIRY_S, prefix=[sys.executable, "-c", SLOW])
    hub.address = f"tcp://127.0.0.1:{free_port()}"  # (a prefix would mean the testbed's fixed port)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2 * PEERS)  # (1,023 by default)
    with hub:
        ep = connect(hub.address, hub.token, name="beating", engine="tcp", heartbeat_s=BEAT_S)
        flood = [HubClient(hub.address, hub.token, ctx=ctx) for _ in range(PEERS)]
        try:
            time.sleep(3 * BEAT_S)
            began = time.monotonic()
            sent = [(client, [client.send(p.Plan(name="ghost", model="policy", version=1, window=4))
                              for _ in range(EACH)]) for client in flood]
            for client, rids in sent:  # every plan answered (each refused: nobody is "ghost")
                for rid in rids:
                    with pytest.raises(HubError, match="ghost"):
                        client.reply(rid, timeout=60)
            busy = time.monotonic() - began
            st = status(hub, timeout=5)
            assert busy > 6 * EXPIRY_S, f"the flood kept the hub busy {busy:.2f} s only: too light to test"
            assert "expiries" not in st.counters, (st.counters, [e for e in st.events if e.kind == "expired"])
            assert [e.name for e in st.endpoints if e.alive] == ["beating"]
            assert ep.service.registrations == 1
        finally:
            for client in flood:
                client.close()
            ctx.term()
            ep.close(drain_timeout=0)
