"""`th status --watch`'s view: rates and stalls come from consecutive snapshots."""

from rich.console import Console

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.launch.state import ClusterState
from tensorhub_cli.ui.watch import Watch


def snapshot(held: int, uptime: float) -> p.StatusReply:
    eps = [p.EndpointStatus(name="rollout-0", node="node2", role="rollout", kind="endpoint", alive=True,
                            heartbeat_age_s=0.1, replicas=2, rack="rack1", dc="dc1")]
    holders = [p.HolderStatus(name="trainer", held_bytes=100_000_000, complete=True, reliable=True),
               p.HolderStatus(name="rollout-0", held_bytes=held, complete=False, reliable=True)]
    v1 = p.VersionStatus(model="policy", version=1, state="READY", chunks=10, nbytes=100_000_000, replicas=1,
                         complete_replicas=1, holders=[p.HolderStatus(name="rollout-0", held_bytes=100_000_000,
                                                                      complete=True, reliable=True)])
    v2 = p.VersionStatus(model="policy", version=2, state="READY", chunks=10, nbytes=100_000_000, replicas=2,
                         complete_replicas=1, holders=holders)
    events = [p.Event(seq=1, t=1.0, kind="ready", endpoint="trainer", model="policy", version=2)]
    return p.StatusReply(cluster="demo", uptime_s=uptime, endpoints=eps, versions=[v1, v2], counters={}, events=events)


def shown(watch: Watch, now: float, reply: p.StatusReply) -> str:
    state = ClusterState(cluster="demo", launcher="local", hub_address="tcp://127.0.0.1:1",
                         hub_node_address="127.0.0.1", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0)
    console = Console(record=True, width=220)
    console.print(watch.render(now, state, reply, {}, {}))
    return console.export_text()


def row_of(text: str, name: str) -> str:
    """The lines of ``name``'s row (a cell of several names goes on over the next lines)."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
    block = [lines[i]]
    for line in lines[i + 1:]:
        if not line.startswith(" "):
            break
        block.append(line)
    return "\n".join(block)


def test_a_fetch_shows_progress_rate_stall_and_events():
    watch = Watch()
    first = shown(watch, 10.0, snapshot(20_000_000, 5.0))
    row = row_of(first, "rollout-0")
    assert "policy@1" in row and "policy@2" in row and "0.0s" in row  # holds v1, fetching v2, stall begins
    later = shown(watch, 12.0, snapshot(60_000_000, 7.0))
    row = row_of(later, "rollout-0")
    assert " 20 " in row  # (60 - 20) MB over 2 s
    assert "2.0s" in row  # waiting for v2 since the first snapshot
    assert "ready" in later and "policy@2" in later.split("last events")[1]


def test_a_finished_fetch_is_forgotten():
    watch = Watch()
    shown(watch, 10.0, snapshot(20_000_000, 5.0))
    done = snapshot(100_000_000, 6.0)
    done.versions[1].holders[1].complete = True
    text = shown(watch, 11.0, done)
    row = row_of(text, "rollout-0")
    assert "policy@1" in row and "policy@2" in row and "1.0s" not in row  # holds it now; no stall shown
    assert not watch._prev and not watch._partial_since


def test_the_watch_view_reads_at_80_columns():
    from .test_cli_width import split_names

    state = ClusterState(cluster="demo", launcher="local", hub_address="tcp://127.0.0.1:1",
                         hub_node_address="127.0.0.1", metrics_port=None, heartbeat_s=0.5, expiry_s=3.0)
    console = Console(record=True, width=80)
    console.print(Watch().render(10.0, state, snapshot(20_000_000, 5.0), {}, {}))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert not split_names(text, ["rollout-0", "trainer", "policy@1", "policy@2"]), text
    assert "rollout-0" in text.split("endpoints")[1], text  # not cut to "rol…"
    row = row_of(text, "rollout-0")  # the endpoints row: its name, what it holds and fetches, whole
    assert "policy@1" in row and "policy@2" in row and "0.0s" in row, text
