"""`th publish --from` a safetensors file, then `th sync`, on a local cluster: every
rollout endpoint ends up with tensors equal to the file; failures name the endpoint.
Then the Python API as an application calls it against a real hub process: a fetch
waits for a version not published yet (within its timeout), and every misuse raises
one of ``tensorhub_cli``'s errors naming the argument."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

import tensorhub_cli
from tensorhub_cli import BadArgument, EndpointError, TensorHubError, VersionNotFound, VersionTimeout
from tensorhub_cli.launch.procs import stop_child

from ..conftest import free_port
from .peers import Worker
from .test_hub_service import TOKEN, start_hub, token_file  # noqa: F401 (token_file is a fixture)
from .test_local_cluster import cluster, th  # noqa: F401 (cluster is a fixture)

pytestmark = pytest.mark.integration


def rollout(name: str, cluster_name: str, node: str) -> Worker:
    return Worker("-", "-", name, extra=["--cluster", cluster_name, "--node", node])


def test_publish_from_a_checkpoint_then_sync_every_rollout(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    g = torch.Generator().manual_seed(11)
    ckpt = tmp_path / "ckpt.safetensors"
    save_file({"embed.weight": torch.randn(512, 1024, generator=g), "norm.weight": torch.randn(1024, generator=g),
               "head.bias": torch.randn(3, generator=g).to(torch.bfloat16)}, str(ckpt))
    workers = [rollout("rollout-0", name, "node2"), rollout("rollout-1", name, "node3")]
    try:
        for w in workers:
            assert w.ask("accept_sync", model="policy")["accepting"] == "policy"
        pub = th("publish", "policy", "--from", str(ckpt), "--node", "node1", "-c", name, check=True)
        assert "published policy@1" in pub.stdout
        synced = th("sync", "policy", "--role", "rollout", "-c", name, "--json", check=True)
        doc = json.loads(synced.stdout)
        assert doc["version"] == 1 and sorted(doc["targets"]) == ["rollout-0", "rollout-1"]
        for w in workers:
            assert w.ask("compare_file", path=str(ckpt))["equal"], w.name
        versions = json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout)
        complete = {h["name"] for h in versions[0]["holders"] if h["complete"]}
        assert complete >= {"agent-node1", "rollout-0", "rollout-1"}
        assert versions[0]["reliable_copies"] >= 1

        # A target that cannot take the version fails the sync, by name.
        workers.append(rollout("rollout-2", name, "node2"))  # never called accept_sync
        assert workers[-1].hello["ready"]
        failed = th("sync", "policy", "--role", "rollout", "-c", name, "--json")
        assert failed.returncode == 1
        assert "rollout-2" in failed.stderr and "accepts no sync" in failed.stderr
        assert "rollout-0" not in failed.stderr
    finally:
        for w in workers:
            w.stop()


def test_publish_and_sync_name_what_is_wrong(cluster, tmp_path):  # noqa: F811
    name, _ = cluster
    missing = th("publish", "policy", "--from", str(tmp_path / "nope.safetensors"), "-c", name)
    assert missing.returncode == 2 and "nope.safetensors: no such file" in missing.stderr
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint")
    bad = th("publish", "policy", "--from", str(junk), "-c", name)
    assert bad.returncode == 2 and "not a safetensors file" in bad.stderr
    node = th("publish", "policy", "--from", str(junk), "--node", "node9", "-c", name)
    assert node.returncode == 2 and "--node 'node9' is not in cluster" in node.stderr
    nothing = th("sync", "policy", "--role", "rollout", "-c", name)
    assert nothing.returncode == 2 and "no READY version" in nothing.stderr


def test_unpublishing_the_last_copy_makes_an_agent_pull_a_retained_one_first(cluster):  # noqa: F811
    name, _ = cluster
    trainer = rollout("trainer-0", name, "node1")
    reader = rollout("rollout-0", name, "node2")
    try:
        trainer.ask("publish", model="policy", version=1, seed=12, mib=4, chunk_mib=1)
        trainer.ask("unpublish", model="policy", version=1, timeout=60)  # returns after the drain + the copy
        versions = json.loads(th("versions", "policy", "-c", name, "--json", check=True).stdout)
        (v,) = versions
        holders = {h["name"]: h for h in v["holders"]}
        assert v["state"] == "READY" and "trainer-0" not in holders
        agents = [h for n, h in holders.items() if n.startswith("agent-") and h["complete"] and h["reliable"]]
        assert agents, holders  # the retained copy lives in an agent's host memory now
        res = reader.ask("fetch", model="policy", seed=12, mib=4)
        assert res.get("version") == 1 and res["equal"], res  # and it serves readers
    finally:
        trainer.stop()
        reader.stop()


@pytest.fixture
def api(token_file):  # noqa: F811
    """A real hub process; ``join(name)`` connects as an application would."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc, client = start_hub(token_file, address)
    eps = []

    def join(name: str):
        eps.append(tensorhub_cli.connect(hub=address, token=TOKEN, name=name, engine="tcp", heartbeat_s=0.2))
        return eps[-1]

    yield join
    for ep in eps:
        ep.close(drain_timeout=0)
    client.close()
    stop_child(proc)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(4096, generator=g), "b": torch.randn(300, generator=g)}


def publish_later(ep, version: int, delay: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), ep.publish("policy", version, weights(version))))
    t.start()
    return t


@pytest.mark.parametrize("version", [2, "latest"])
def test_a_fetch_waits_for_a_version_not_published_yet(api, version):
    pub, reader = api("trainer"), api("rollout")
    if version == 2:
        pub.publish("policy", 1, weights(1))  # the model exists; version 2 does not yet
    into = {k: torch.zeros_like(v) for k, v in weights(2).items()}
    later = publish_later(pub, 2, 1.0)
    began = time.monotonic()
    try:
        got = reader.fetch("policy", version, into=into, timeout=20)  # before: HubError not_found at once
    finally:
        later.join(10)
    assert got == 2 and time.monotonic() - began >= 0.9
    assert all(torch.equal(into[k], v) for k, v in weights(2).items())


def test_a_fetch_gives_up_waiting_at_its_timeout_with_a_named_error(api):
    reader = api("rollout")
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    began = time.monotonic()
    with pytest.raises(VersionTimeout) as exc:
        reader.fetch("policy", "latest", into=into, timeout=1.0)
    waited = time.monotonic() - began
    assert 1.0 <= waited < 5, waited
    assert isinstance(exc.value, TimeoutError) and isinstance(exc.value, VersionNotFound)
    assert exc.value.code == "not_found" and "policy@latest" in str(exc.value) and "1s" in str(exc.value)
    assert not reader.holdings(), "a fetch that never started holds nothing"


def test_a_fetch_that_must_not_wait_fails_at_once_naming_the_version(api):
    pub, reader = api("trainer"), api("rollout")
    pub.publish("policy", 1, weights(1))
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    began = time.monotonic()
    with pytest.raises(VersionNotFound) as exc:
        reader.fetch("policy", 3, into=into, timeout=30, wait=False)
    assert time.monotonic() - began < 3 and not isinstance(exc.value, TimeoutError)
    assert exc.value.code == "not_found" and "policy@3" in str(exc.value)


def test_a_waiting_fetch_holds_up_no_other_call_of_its_endpoint(api):
    pub, reader = api("trainer"), api("rollout")
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    result: dict = {}

    def fetch():
        try:
            result["version"] = reader.fetch("policy", "latest", into=into, timeout=20)
        except Exception as exc:  # reported to the test thread below
            result["error"] = exc

    t = threading.Thread(target=fetch)
    t.start()
    time.sleep(0.3)  # it is waiting now
    began = time.monotonic()
    assert reader.versions() == []
    pub.publish("policy", 1, weights(1))
    assert time.monotonic() - began < 3, "another call of the endpoint waited behind the waiting fetch"
    t.join(20)
    assert result.get("version") == 1, result


def test_two_threads_fetching_one_version_both_end_holding_it_once(api):
    """A retention pull and a `th sync` of one version run on an agent's two workers at
    once. Both fetches must return it: the second waits for the first, whose replica is
    its outcome. Before ``Endpoint._claim``, both found it unheld while making their
    destination, and the second to register failed "already holds" (seen in CI)."""
    from tensorhub_cli.layout import allocate

    pub, reader = api("trainer"), api("agent")
    pub.publish("policy", 1, weights(1))
    made: list[str] = []

    def slow_into(shards):  # an agent's store files take a while to make: the window of the race
        made.append(threading.current_thread().name)
        time.sleep(0.5)
        return allocate(shards)

    outcome: dict = {}

    def fetch(who: str):
        try:
            outcome[who] = reader.fetch("policy", 1, into=slow_into, timeout=20)
        except Exception as exc:  # reported to the test thread below
            outcome[who] = exc

    threads = [threading.Thread(target=fetch, args=(w,), name=w) for w in ("retain", "sync")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outcome == {"retain": 1, "sync": 1}, outcome
    assert len(made) == 1, f"both fetches made a destination: {made}"
    held = [h for h in reader.holdings() if (h.model, h.version) == ("policy", 1)]
    assert len(held) == 1 and held[0].rank < 0 and len(held[0].held) == sum(len(m.chunks) for m in held[0].shards)


@pytest.mark.parametrize("call, needle", [
    (lambda ep, into: ep.fetch("policy", "lates", into=into), "version"),
    (lambda ep, into: ep.fetch("policy", 0, into=into), "version"),
    (lambda ep, into: ep.fetch("policy", True, into=into), "version"),
    (lambda ep, into: ep.fetch("policy", 1, into=None), "into"),
    (lambda ep, into: ep.fetch(123, 1, into=into), "model"),
    (lambda ep, into: ep.fetch("bad name!", 1, into=into), "model"),
    (lambda ep, into: ep.fetch("policy", 1, into=into, timeout=-1), "timeout"),
    (lambda ep, into: ep.fetch("policy", 1, into=into, window=0), "window"),
    (lambda ep, into: ep.fetch("policy", 1, into=into, group=""), "group"),
    (lambda ep, into: ep.publish("policy", 0, weights(1)), "version"),
    (lambda ep, into: ep.publish(["policy"], 1, weights(1)), "model"),
    (lambda ep, into: ep.publish("policy", 2, None), "state_dict"),
    (lambda ep, into: ep.publish("policy", 2, weights(1), shard=(2, 1)), "shard"),
    (lambda ep, into: ep.publish("policy", 2, weights(1), timeout=float("nan")), "timeout"),
    (lambda ep, into: ep.unpublish("policy", "1"), "version"),
    (lambda ep, into: ep.unpublish("policy", 1, timeout=0), "timeout"),
    (lambda ep, into: ep.versions(7), "model"),
    (lambda ep, into: ep.close(drain_timeout=-1), "drain_timeout"),
])
def test_every_bad_argument_raises_bad_argument_naming_it_and_changes_nothing(api, call, needle):
    ep = api("e")
    ep.publish("policy", 1, weights(1))
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    with pytest.raises(BadArgument) as exc:
        call(ep, into)
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, TensorHubError)
    assert needle in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    assert [h.version for h in ep.holdings()] == [1], "a refused call changed what the endpoint holds"
    assert not any(t.nbytes and t.count_nonzero() for t in into.values()), "a refused fetch wrote into its target"


def test_calls_after_close_raise_the_closed_endpoint_error(api):
    ep = api("e")
    ep.close(drain_timeout=0)
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    for call in (lambda: ep.fetch("policy", 1, into=into), lambda: ep.publish("policy", 1, weights(1)),
                 lambda: ep.unpublish("policy", 1), lambda: ep.versions(), lambda: ep.accept_sync("policy", into)):
        with pytest.raises(EndpointError, match="closed") as exc:
            call()
        assert isinstance(exc.value, TensorHubError)


def counting(engine) -> dict:
    """Counts ``engine``'s register/deregister calls (it still makes them)."""
    calls = {"register": 0, "deregister": 0}
    for name in calls:
        def wrapped(*args, _real=getattr(engine, name), _name=name):
            calls[_name] += 1
            return _real(*args)
        setattr(engine, name, wrapped)
    return calls


def test_in_place_versions_register_once_at_the_publisher_and_at_the_reader(api):
    pub, reader = api("trainer"), api("rollout")
    published, fetched = counting(pub.engine), counting(reader.engine)
    sd = weights(1)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    for version in (1, 2, 3):
        if version > 1:
            pub.unpublish("policy", version - 1, timeout=20)
            for t in sd.values():  # the optimizer step, in place
                t.mul_(0.5).add_(version)
        pub.publish("policy", version, sd)
        assert reader.fetch("policy", version, into=into, timeout=20) == version  # into the same tensors
        assert all(torch.equal(into[k], v) for k, v in sd.items()), version
    assert published == {"register": 1, "deregister": 0} and fetched == {"register": 1, "deregister": 0}
    pub.close(drain_timeout=0)
    reader.close(drain_timeout=0)
    assert published == {"register": 1, "deregister": 1} and fetched == {"register": 1, "deregister": 1}


def test_fetch_makes_the_callers_stream_wait_for_its_last_scatter_before_returning(api, monkeypatch):
    """The real transfer loop against a real hub, with torch's CUDA calls recorded
    (``endpoint.streams``: host tensors go through the same calls, as no-ops)."""
    from tensorhub_cli.endpoint import streams
    from tensorhub_cli.layout import Placed

    from ..unit.test_stream_order import Recorder

    log: list = []
    monkeypatch.setattr(streams, "_streams", Recorder(log))
    real_finish = Placed.finish

    def finish_logged(self, chunk):
        if chunk in self.scatter:
            log.append(("scatter", chunk))
        return real_finish(self, chunk)

    monkeypatch.setattr(Placed, "finish", finish_logged)
    pub, reader = api("trainer"), api("rollout")
    pub.publish("policy", 1, weights(1))  # "a" and "b" share a chunk: the reader stages and scatters it
    into = {k: torch.zeros_like(v) for k, v in weights(1).items()}
    log.clear()
    assert reader.fetch("policy", 1, into=into, timeout=20) == 1
    done = list(log)
    steps = [e[0] for e in done]
    last = max(i for i, k in enumerate(steps) if k == "scatter")
    records = [e for e in done[last:] if e[0] == "record"]
    waits = [e for e in done[last:] if e[0] == "wait"]
    assert records and waits, steps
    assert waits[-1][1] == f"{threading.current_thread().name}/-1", waits  # the caller's current stream
    assert waits[-1][2] is records[-1][2] and steps.index("wait", last) > steps.index("record", last)
    assert all(torch.equal(into[k], v) for k, v in weights(1).items())
