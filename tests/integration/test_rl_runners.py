"""The RL loop on a local cluster (`th up`: hub + agents): runners/trainer.py and
runners/rollout.py as real processes, a real (tiny) transformers or torch model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from tensorhub_cli import connect
from tensorhub_cli.bench.rl import Runner

pytestmark = pytest.mark.integration

TINY = ["--hidden", "64", "--layers", "2", "--vocab", "512"]


def th(*args, timeout=90):
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"th {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def _cluster(spec, tmp_path):
    name = yaml.safe_load(spec.read_text())["name"]
    th("up", str(spec))
    runners: list[Runner] = []

    def start(name_, module, node, *args, env: dict | None = None) -> Runner:
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else None
        r = Runner(name_, module, ["--cluster", name, "--node", node, *args], tmp_path, prefix=prefix)
        runners.append(r)
        return r

    yield name, start
    for r in reversed(runners):
        r.stop()
    subprocess.run([sys.executable, "-m", "tensorhub_cli", "down", "-c", name], capture_output=True, timeout=90)


@pytest.fixture
def cluster(th_home, local_spec, tmp_path):
    yield from _cluster(local_spec, tmp_path)


@pytest.fixture
def tcp_cluster(th_home, local_spec, tmp_path):
    """The local cluster on the tcp engine, whose serving a test can throttle
    (``TH_TEST_SERVE_BPS``, ``engines.serve``)."""
    doc = yaml.safe_load(local_spec.read_text())
    local_spec.write_text(yaml.safe_dump({**doc, "engine": "tcp"}, sort_keys=False))
    yield from _cluster(local_spec, tmp_path)


def finished(r: Runner, timeout: float = 180) -> dict:
    done = r.wait_for("done", timeout)
    assert r.proc.wait(timeout=60) == 0, r.tail()
    return done


def test_every_version_two_rollouts_load_passes_checksum_and_probe(cluster):
    _, start = cluster
    rollouts = [start(f"rollout-{i}", "runners.rollout", node, *TINY, "--until-version", "3", "--rollout-s", "0.1")
                for i, node in enumerate(("node2", "node3"))]
    for r in rollouts:
        r.wait_for("started", 120)
    trainer = start("trainer", "runners.trainer", "node1", *TINY, "--steps", "3", "--step-s", "1.0", "--linger-s", "60")
    for r in rollouts:
        finished(r)
        loaded = r.of("loaded")
        assert loaded[-1]["version"] == 3
        assert [e["version"] for e in loaded] == sorted({e["version"] for e in loaded})  # each once, in order
        assert all(e["probe_ok"] and e["corrupt"] == 0 for e in loaded)
        assert not r.of("mismatch")
    assert [e["version"] for e in trainer.of("published")] == [1, 2, 3]


def test_a_rollout_stops_on_weights_whose_probe_is_not_the_trainers(cluster):
    """The check can fail: a version whose probe does not match its weights stops the
    rollout with exit 3 before it generates, never with a warning."""
    name, start = cluster
    from runners import model as M

    M.deterministic()
    cfg = M.ModelConfig(hidden=64, layers=2, vocab=512)
    net = M.build(cfg)
    wrong = M.probe(net) + 1e-3
    with connect(cluster=name, name="fake-trainer", node="node1", role="trainer") as ep:
        ep.publish("policy", 1, {**M.weights(net), M.PROBE: wrong})
        r = start("rollout-0", "runners.rollout", "node2", *TINY, "--until-version", "1")
        assert r.proc.wait(timeout=120) == 3, r.tail()
        mismatch = r.of("mismatch")
        assert mismatch and mismatch[0]["version"] == 1 and mismatch[0]["problems"] == []
        assert 0 < mismatch[0]["probe_max_abs_diff"] <= 2e-3
        assert not r.of("loaded")


def test_in_place_publish_never_lets_a_rollout_read_a_half_updated_parameter(tcp_cluster):
    """The optimizer step is spread over 0.8 s (one parameter at a time) while rollouts
    keep fetching. Unpublish-drain before the step means no read ever sees a mix: no
    chunk fails its checksum, every loaded version passes the probe. The run must
    actually overlap fetches with steps, or it proves nothing."""
    _, start = tcp_cluster
    # One read in flight over 1 MiB chunks of a 69 MB model, the trainer serving each
    # read at 40 MB/s: a fetch (about 2 s) outlasts the gap between a publish and the
    # next step (a forward and backward, well under a second), so reads of the trainer
    # always meet its next unpublish and step (6 of 8 attempts overlapped a step, in
    # each of two runs). Unthrottled, a fetch took 0.15-0.5 s and fell between two
    # steps in two of three full-suite runs.
    model = ["--hidden", "512", "--layers", "4", "--vocab", "512"]
    rollouts = [start(f"rollout-{i}", "runners.rollout", node, *model, "--until-version", "4", "--rollout-s", "0",
                      "--window", "1", "--fetch-timeout-s", "30") for i, node in enumerate(("node2", "node3"))]
    for r in rollouts:
        r.wait_for("started", 120)
    trainer = start("trainer", "runners.trainer", "node1", *model, "--steps", "4", "--publish-mode", "in-place",
                    "--slow-step-s", "0.8", "--step-s", "0", "--linger-s", "60", "--chunk-mb", "1",
                    env={"TH_TEST_SERVE_BPS": str(40_000_000)})
    for r in rollouts:
        finished(r, 150)
    steps = [(e["step_began"], e["step_ended"]) for e in trainer.of("published")]
    attempts = [(e["began"], e["t"]) for r in rollouts for e in r.of("loaded") + r.of("retry")]
    overlapped = [a for a in attempts for s in steps if a[0] < s[1] and s[0] < a[1]]
    assert overlapped, f"no fetch overlapped an optimizer step: steps {steps}, fetches {attempts}"
    for r in rollouts:
        assert not r.of("mismatch")
        assert all(e["corrupt"] == 0 and e["probe_ok"] for e in r.of("loaded"))
        assert not [e for e in r.of("retry") if "checksum" in e["reason"]]
        assert r.of("loaded")[-1]["version"] == 4


def test_an_elastic_joiner_reaches_latest_without_reading_from_the_trainer(cluster):
    """Contract: once replicas exist, a joiner fetches from them; the trainer's send
    counter (bytes read from a publisher) stays at 0 for it."""
    name, start = cluster
    standing = start("rollout-0", "runners.rollout", "node2", *TINY, "--rollout-s", "0.1", "--duration-s", "120")
    standing.wait_for("started", 120)
    trainer = start("trainer", "runners.trainer", "node1", *TINY, "--steps", "2", "--step-s", "0.5",
                    "--linger-s", "120")
    trainer.wait_for("done", 120)
    standing.wait_for("loaded", 60, version=2)
    joiner = start("rollout-spot-0", "runners.rollout", "node3", *TINY, "--spot", "--until-version", "2")
    finished(joiner)
    first = joiner.of("loaded")[0]
    assert first["version"] == 2 and first["bytes"] > 0
    assert first["from_publishers"] == 0, first
    status = json.loads(th("status", "-c", name, "--json").stdout)
    assert status["status"]["counters"].get("bytes_planned.from_publishers.spot", 0) == 0


def _state(cfg, version: int) -> dict:
    """Version ``version`` of the tiny model: its weights shifted by 0.01 * version, and
    the probe of exactly those weights."""
    from runners import model as M

    net = M.build(cfg)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * version)
    return {**M.weights(net), M.PROBE: M.probe(net)}


def _held_by(ep, who: str) -> dict[int, bool]:
    """{version: complete} of the replicas the hub lists for ``who`` (draining ones left out)."""
    return {v.version: h.complete for v in ep.versions("policy") for h in v.holders
            if h.name == who and not h.draining}


def test_a_double_buffered_rollout_serves_v_while_it_loads_v_plus_1_and_lets_it_go_after_the_swap(cluster):
    """--double-buffer: once v+1 is swapped in, v is still a published replica, so a
    reader gets v from the rollout after its publisher left; v is unpublished only after
    that swap, when v+2 needs its buffer; the rollout never holds more than two versions.
    In-place, fetching v+1 would have unpublished v first, and the reader would find no
    holder. (Hub state and event order, no timing.)"""
    name, start = cluster
    from runners import model as M

    M.deterministic()
    cfg = M.ModelConfig(hidden=64, layers=2, vocab=512)
    states = {v: _state(cfg, v) for v in (1, 2, 3)}
    # (tcp in this process: one NIXL agent after another in the pytest process has
    # crashed in NIXL's notification polling; the rollout reads them with its own)
    with connect(cluster=name, name="fake-trainer", node="node1", role="trainer", engine="tcp") as trainer:
        trainer.publish("policy", 1, states[1])
        r = start("rollout-0", "runners.rollout", "node2", *TINY, "--double-buffer", "--rollout-s", "0.1",
                  "--duration-s", "300")
        assert r.wait_for("started", 120)["buffers"] == 2
        r.wait_for("loaded", 120, version=1)
        trainer.publish("policy", 2, states[2])
        loaded = r.wait_for("loaded", 120, version=2)
        assert loaded["previous"] == 1 and loaded["buffers"] == 2 and loaded["bytes"] > 0
        assert _held_by(trainer, "rollout-0") == {1: True, 2: True}  # v1 never unpublished

        trainer.unpublish("policy", 1)  # the rollout is now v1's only holder
        into = {n: torch.empty_like(t) for n, t in states[1].items()}
        with connect(cluster=name, name="reader", node="node3", role="reader", engine="tcp") as reader:
            assert reader.fetch("policy", 1, into=into, timeout=60) == 1
            assert reader.last_fetch["bytes"] > 0 and reader.last_fetch["from_publishers"] == 0
        assert all(torch.equal(into[n], t) for n, t in states[1].items())

        trainer.publish("policy", 3, states[3])
        r.wait_for("loaded", 120, version=3)
        # v1's buffer took v3; v2 (swapped out just now) stays published in the other
        assert _held_by(trainer, "rollout-0") == {2: True, 3: True}
        kinds = [(e["event"], e.get("version")) for e in r.events if e["event"] in ("loaded", "unpublished")]
        assert kinds == [("loaded", 1), ("loaded", 2), ("unpublished", 1), ("loaded", 3)], kinds
        assert not r.of("mismatch")
        r.stop()
        assert r.proc.returncode == 0, r.tail()


def _versions(name):
    return {v["version"]: v for v in json.loads(th("versions", "-c", name, "--json").stdout)}


def _wait(what, check, timeout=120):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_scale_and_failover_keep_every_retained_version_ready(th_home, local_spec):
    """`th scale` starts runners where the spec allows; `th failover` of the node with
    the only reliable rollout drains it (retention pulls a host copy first), restarts
    its rollout elsewhere, and every version the policy keeps (keep_latest 2) stays
    READY with a reliable copy. The trainer has finished and left: no copy of its own
    keeps the versions up."""
    doc = yaml.safe_load(local_spec.read_text())
    name = doc["name"]
    nodes = doc["topology"]["datacenters"][0]["racks"][0]["nodes"]
    nodes[0]["gpus"] = 2  # node1: room for the trainer and one rollout
    doc["roles"]["trainer"]["runner"] = {"command": "runners.trainer",
                                         "args": [*TINY, "--steps", "3", "--step-s", "1.0", "--linger-s", "0"]}
    doc["roles"]["rollout"]["select"] = {"nodes": ["node2", "node3", "node1"]}
    doc["roles"]["rollout"]["runner"] = {"command": "runners.rollout", "args": [*TINY, "--rollout-s", "0.1"]}
    local_spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    th("up", str(local_spec))
    try:
        up = json.loads(th("scale", "rollout=2", "-c", name, "--json", timeout=200).stdout)
        assert sorted(up["started"]) == ["rollout-node2", "rollout-node3"]  # fewest runners first, then select order
        th("scale", "trainer+1", "-c", name, timeout=200)

        def settled():
            vs = _versions(name)
            v3 = vs.get(3)
            holders = {h["name"] for h in v3["holders"] if h["complete"]} if v3 else set()
            return v3 and v3["state"] == "READY" and {"rollout-node2", "rollout-node3"} <= holders \
                and not any(n.startswith("trainer") for v in vs.values() for n in (h["name"] for h in v["holders"]))
        _wait("both rollouts holding version 3, the trainer gone", settled)

        moved = json.loads(th("failover", "node2", "-c", name, "--json", timeout=400).stdout)
        assert moved == {"stopped": ["rollout-node2"], "drained": ["agent-node2"], "started": ["rollout-node1"]}
        vs = _versions(name)
        assert sorted(vs) == [2, 3] and all(v["state"] == "READY" and v["reliable_copies"] >= 1 for v in vs.values()), vs
        for v in vs.values():
            assert not any(h["name"].endswith("node2") for h in v["holders"]), v["holders"]
        _wait("the replacement holding version 3", lambda: "rollout-node1" in {
            h["name"] for h in _versions(name)[3]["holders"] if h["complete"]})
        status = json.loads(th("status", "-c", name, "--json").stdout)["status"]
        kinds = [e["kind"] for e in status["events"]]
        assert "scaled" in kinds and "failed_over" in kinds

        down = json.loads(th("scale", "rollout-1", "-c", name, "--json", timeout=200).stdout)
        assert down["stopped"] == ["rollout-node1"]  # the newest leaves first
        assert all(v["state"] == "READY" for v in _versions(name).values())
    finally:
        subprocess.run([sys.executable, "-m", "tensorhub_cli", "down", "-c", name], capture_output=True, timeout=200)


def test_a_sharded_trainer_publishes_one_version_from_two_ranks(cluster):
    """--world 2: each rank publishes its shard; the version is READY once both are in,
    and a rollout loads the union into one model and passes the probe."""
    _, start = cluster
    rollout = start("rollout-0", "runners.rollout", "node3", *TINY, "--until-version", "2", "--rollout-s", "0.1")
    rollout.wait_for("started", 120)
    ranks = [start(f"trainer-{r}", "runners.trainer", node, *TINY, "--steps", "2", "--step-s", "1.0", "--world", "2",
                   "--rank", str(r), "--linger-s", "60") for r, node in enumerate(("node1", "node2"))]
    finished(rollout)
    loaded = rollout.of("loaded")
    assert loaded[-1]["version"] == 2 and all(e["probe_ok"] for e in loaded)
    # (Where the bytes came from varies: no single endpoint holds a whole sharded
    # version, so retention may have an agent pull a copy the rollout then reads.)
    for r in ranks:
        assert [e["version"] for e in r.of("published")] == [1, 2]
