"""Operator commands on the pure hub: sync/load become Commands for the right
endpoints, reports and hub events land in the bounded log, holder status adds up,
and a Plan that carries progress equals a Progress followed by a Plan."""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.state import EVENTS_KEPT
from tensorhub_cli.hub.machine import HubFault

from .hubkit import info, manifest, new_hub, reg, sends


def ready_hub():
    hub = new_hub()
    reg(hub, 0, info("pub"), info("agent-n2", node="n2", kind="agent"),
        p.EndpointInfo(name="r0", node="n3", role="rollout", pid=2), p.EndpointInfo(name="r1", node="n4", role="rollout", pid=3))
    hub.publish(0, p.Publish(name="pub", model="m", version=1, manifest=manifest(4)))
    hub.take_outbound()
    return hub


def test_sync_commands_every_live_endpoint_of_the_role_to_fetch_one_version():
    hub = ready_hub()
    hub.publish(0, p.Publish(name="pub", model="m", version=2, manifest=manifest(4, salt=2)))
    got = hub.sync(0, p.Sync(model="m", role="rollout"))
    assert got == p.Synced(version=2, targets=["r0", "r1"])
    cmds = sends(hub.take_outbound(), action=None)
    assert {(s.endpoint, s.body.action, s.body.version) for s in cmds} == {("r0", "fetch", 2), ("r1", "fetch", 2)}
    by_node = hub.sync(0, p.Sync(model="m", version=1, node="n2"))
    assert by_node.targets == ["agent-n2"] and by_node.version == 1


@pytest.mark.parametrize("op, code, needle", [
    (p.Sync(model="m"), "malformed", "exactly one of role or node"),
    (p.Sync(model="m", role="x", node="n1"), "malformed", "exactly one of role or node"),
    (p.Sync(model="m", role="trainer"), "not_found", "no live endpoint with role 'trainer'"),
    (p.Sync(model="nope", role="rollout"), "not_found", "no READY version"),
    (p.Sync(model="m", version=9, role="rollout"), "not_found", ""),
])
def test_sync_refusals_name_the_problem_and_queue_nothing(op, code, needle):
    hub = ready_hub()
    with pytest.raises(HubFault) as err:
        hub.sync(0, op)
    assert err.value.code == code and needle in err.value.message
    assert not hub.take_outbound()


def test_load_goes_to_the_nodes_agent_only_when_it_is_alive_and_the_version_is_new():
    hub = ready_hub()
    hub.load_checkpoint(0, p.Load(node="n2", model="m", version=5, path="/ck.safetensors", chunk_bytes=1 << 20))
    (cmd,) = sends(hub.take_outbound(), action=None)
    assert cmd.endpoint == "agent-n2" and cmd.body == p.Command(action="load", model="m", version=5,
                                                                 path="/ck.safetensors", chunk_bytes=1 << 20)
    with pytest.raises(HubFault, match="has no live agent"):
        hub.load_checkpoint(0, p.Load(node="n9", model="m", version=5, path="/x"))
    with pytest.raises(HubFault, match="exists already"):
        hub.load_checkpoint(0, p.Load(node="n2", model="m", version=1, path="/x"))
    with pytest.raises(HubFault, match="has no live agent"):
        hub.load_checkpoint(100.0, p.Load(node="n2", model="m", version=6, path="/x"))  # expired by then


def test_reports_and_hub_events_are_kept_in_order_and_bounded():
    hub = ready_hub()
    hub.report(1.0, p.Report(name="r0", kind="fetch_failed", model="m", version=1, message="boom"))
    kinds = [(e.kind, e.endpoint) for e in hub.status(1.0).events]
    assert kinds[0] == ("ready", "pub") and kinds[-1] == ("fetch_failed", "r0")
    for i in range(EVENTS_KEPT + 10):
        hub.report(2.0, p.Report(name="r0", kind="fetched", model="m", version=1))
    seqs = [e.seq for e in hub.events]
    assert len(seqs) == EVENTS_KEPT and seqs == sorted(seqs) and seqs[-1] == EVENTS_KEPT + 12
    with pytest.raises(HubFault, match="is not registered"):
        hub.report(2.0, p.Report(name="ghost", kind="fetched", model="m", version=1))


def test_a_dropped_version_is_discarded_by_the_agents_that_hold_copies_of_it():
    hub = new_hub()  # keep_latest 2
    reg(hub, 0, info("pub"), info("agent-n2", node="n2", kind="agent"), info("r", node="n3"))
    for version in (1, 2):
        hub.publish(0, p.Publish(name="pub", model="m", version=version, manifest=manifest(2, salt=version)))
        for reader in ("agent-n2", "r"):
            hub.plan(0, p.Plan(name=reader, model="m", version=version))
            hub.progress(0, p.Progress(name=reader, model="m", version=version, chunks=[0, 1]))
    hub.take_outbound()
    hub.publish(0, p.Publish(name="pub", model="m", version=3, manifest=manifest(2, salt=3)))
    assert 1 not in hub.models["m"]
    released = [(s.endpoint, s.body.version) for s in sends(hub.take_outbound(), action="discard")]
    assert released == [("agent-n2", 1)]  # agents only: other holders unpublish on their own


def test_holder_status_counts_bytes_of_mixed_chunk_sizes():
    hub = new_hub()
    reg(hub, 0, info("pub"), info("r", node="n2", reliable=False))
    m = p.Manifest(tensors=[p.TensorMeta(name="w", dtype="uint8", shape=[2500], nbytes=2500, offset=0)],
                   chunks=[p.ChunkMeta(nbytes=1000, checksum=1), p.ChunkMeta(nbytes=1000, checksum=2),
                           p.ChunkMeta(nbytes=500, checksum=3)], chunk_bytes=1000)
    hub.publish(0, p.Publish(name="pub", model="m", version=1, manifest=m))
    hub.plan(0, p.Plan(name="r", model="m", version=1, window=3))
    hub.progress(0, p.Progress(name="r", model="m", version=1, chunks=[0, 2]))
    (v,) = hub.versions(0, p.Versions(model="m")).versions
    holders = {h.name: h for h in v.holders}
    assert holders["pub"] == p.HolderStatus(name="pub", held_bytes=2500, complete=True, reliable=True)
    assert holders["r"].held_bytes == 1500 and not holders["r"].complete and not holders["r"].reliable
    assert v.reliable_copies == 1 and v.complete_replicas == 1


def test_a_plan_carrying_progress_equals_progress_then_plan():
    def run(combined: bool):
        hub = ready_hub()
        first = hub.plan(0, p.Plan(name="r0", model="m", version=1, window=2))
        done = [r.chunk for r in first.reads]
        if combined:
            second = hub.plan(0, p.Plan(name="r0", model="m", version=1, window=2, chunks=done))
        else:
            hub.progress(0, p.Progress(name="r0", model="m", version=1, chunks=done))
            second = hub.plan(0, p.Plan(name="r0", model="m", version=1, window=2))
        return second, hub.models["m"][1].replicas["r0"].held

    assert run(True) == run(False)
    second, held = run(True)
    assert held.bit_count() == 2 and len(second.reads) == 2
    assert not any(held >> r.chunk & 1 for r in second.reads)  # only what the reader lacks


def test_a_version_being_withdrawn_is_neither_synced_nor_latest_and_its_holders_are_told():
    hub = ready_hub()
    hub.publish(0, p.Publish(name="pub", model="m", version=2, manifest=manifest(4, salt=2)))
    hub.plan(0, p.Plan(name="r0", model="m", version=2, window=1))  # a read of v2 holds its withdrawal back
    hub.take_outbound()
    assert hub.withdraw(0, p.Withdraw(model="m", version=2)) is None
    told = sends(hub.take_outbound(), action="unpublish")
    assert sorted((s.endpoint, s.body.action, s.body.model, s.body.version) for s in told) == [
        ("pub", "unpublish", "m", 2), ("r0", "unpublish", "m", 2)]
    assert hub.sync(0, p.Sync(model="m", role="rollout")).version == 1  # latest, leaving v2 out
    with pytest.raises(HubFault) as err:
        hub.sync(0, p.Sync(model="m", version=2, role="rollout"))
    assert err.value.code == "conflict" and "m@2 is being withdrawn" in err.value.message
    assert [(e.kind, e.message) for e in hub.events if e.kind == "withdraw"] == [("withdraw", "2 holder(s)")]


def test_load_refuses_a_bad_model_name_naming_it():
    hub = ready_hub()
    with pytest.raises(HubFault) as err:
        hub.load_checkpoint(0, p.Load(node="n2", model="my policy", version=5, path="/x"))
    assert err.value.code == "bad_request" and "model 'my policy' is not a valid model name" in err.value.message
    assert not hub.take_outbound()


def test_the_default_handler_unpublishes_a_withdrawn_replica_and_reports_only_a_failure():
    from tensorhub_cli.endpoint.commands import SyncCommands
    from tensorhub_cli.endpoint.errors import EndpointError

    class Ep:
        name, drain_timeout_s = "ep", 42.0

        def __init__(self, held, kind="agent"):
            self.held, self.unpublished, self.reports = held, [], []
            self.info = p.EndpointInfo(name="ep", node="n1", kind=kind)

        def holdings(self):
            return self.held

        def unpublish(self, model, version, *, timeout):
            self.unpublished.append((model, version, timeout))
            if version == 3:
                raise EndpointError("unpublish of m@3 not acknowledged within 42s")

        def report(self, cmd, kind, message="", *, timeout=None):
            self.reports.append((kind, cmd.version, message))

    m = manifest(2)
    ep = Ep([p.Holding(model="m", version=1, world=1, shards=[m], rank=0),  # a publisher's shard
             p.Holding(model="m", version=2, world=1, shards=[m], held=[0]),  # a fetch still filling it
             p.Holding(model="m", version=3, world=1, shards=[m], held=[0, 1])])  # a complete reader copy
    handler = SyncCommands()
    for version in (1, 2, 3, 4):  # (4: let go already)
        handler(ep, p.Command(action="unpublish", model="m", version=version))
    assert ep.unpublished == [("m", 1, 42.0), ("m", 3, 42.0)]
    assert [(kind, v) for kind, v, _ in ep.reports] == [("unpublish_failed", 3)]
    assert "not acknowledged within 42s" in ep.reports[0][2]
    # A runner's own published shard stays its own: its code unpublishes it (the hub
    # then says it is gone); a copy it fetched goes now.
    runner = Ep(ep.held, kind="endpoint")
    for version in (1, 3):
        handler(runner, p.Command(action="unpublish", model="m", version=version))
    assert runner.unpublished == [("m", 3, 42.0)]
