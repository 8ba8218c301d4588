"""`th sync` and `th publish` learn failures from every event since they started (the
hub's ``Events``), not from the last few a status shows: many unrelated events
between the start and the failure must not hide it; events lost to the hub's bound
are reported, and the command falls back to what holders show."""

from __future__ import annotations

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.state import EVENTS_KEPT
from tensorhub_cli.launch import operate

from .hubkit import info, manifest, new_hub, reg

OPS = {p.Sync: "sync", p.Load: "load_checkpoint", p.Note: "note", p.Report: "report", p.Versions: "versions",
       p.Events: "events_since"}


class Client:
    """A HubClient over the pure hub; ``before_poll`` runs once, before the first
    look at the hub after the command was sent (what happens while it sleeps)."""

    def __init__(self, hub, before_poll):
        self.hub, self.before_poll, self.sent = hub, before_poll, False

    def call(self, op, timeout: float):
        if self.sent and self.before_poll is not None:
            hook, self.before_poll = self.before_poll, None
            hook(self.hub)
        if isinstance(op, (p.Sync, p.Load)):
            self.sent = True
        if isinstance(op, p.Status):
            return self.hub.status(1.0)
        return getattr(self.hub, OPS[type(op)])(1.0, op)


def noisy(n: int):
    def hook(hub):
        hub.report(1.0, p.Report(name="r0", kind="fetch_failed", model="m", version=1, message="disk full"))
        for i in range(n):
            hub.note(1.0, p.Note(kind="unrelated", message=f"note {i}"))
    return hook


def synced_hub():
    hub = new_hub()
    reg(hub, 0, info("pub"), p.EndpointInfo(name="r0", node="n3", role="rollout", pid=2))
    hub.publish(0, p.Publish(name="pub", model="m", version=1, manifest=manifest(2)))
    hub.take_outbound()
    return hub


def test_a_failure_followed_by_many_events_still_fails_the_sync():
    client = Client(synced_hub(), noisy(60))  # a status shows the last 50 events only
    run = operate.sync(client, "m", None, "rollout", None, timeout=1.0, poll_s=0.01)
    assert run.targets["r0"].failed == "disk full"


def test_a_failure_followed_by_many_events_still_fails_the_publish():
    hub = synced_hub()
    reg(hub, 0, info("agent-n2", node="n2", kind="agent"))

    def hook(hub):
        hub.report(1.0, p.Report(name="agent-n2", kind="load_failed", model="m", version=2, message="bad file"))
        for i in range(60):
            hub.note(1.0, p.Note(kind="unrelated", message=f"note {i}"))

    client = Client(hub, hook)
    try:
        operate.publish_file(client, "n2", "m", "/ckpt", 2, 1024, timeout=1.0, poll_s=0.01)
    except operate.OperateError as exc:
        assert "bad file" in str(exc)
    else:
        raise AssertionError("publish did not fail")


def test_events_lost_to_the_bound_are_reported_and_holders_still_decide():
    client = Client(synced_hub(), noisy(EVENTS_KEPT + 10))
    said = []
    run = operate.sync(client, "m", None, "rollout", None, timeout=0.3, poll_s=0.01, log=said.append)
    assert run.targets["r0"].failed == "not complete within 0s"  # the failure was lost; the deadline decides
    assert len(said) == 1 and "12 hub event(s) (seq 2..13) were dropped" in said[0]


def test_a_restarted_hub_is_followed_from_its_first_event():
    """Seqs begin again at 1 after a hub restart: the follower must not wait for the new
    hub to pass the old seq before it sees a failure."""
    old = synced_hub()
    for i in range(30):
        old.note(1.0, p.Note(kind="unrelated", message=f"note {i}"))
    new = synced_hub()  # a fresh hub: its seqs start again
    said = []
    events = operate.Events(Client(old, None), since=25, call_timeout=1.0, log=said.append)
    events.client = Client(new, None)
    new.report(1.0, p.Report(name="r0", kind="fetch_failed", model="m", version=1, message="disk full"))
    assert [e.message for e in events.poll() if e.kind == "fetch_failed"] == ["disk full"]
    assert any("restarted" in line for line in said)
