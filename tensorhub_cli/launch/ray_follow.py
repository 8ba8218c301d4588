"""A ``launcher: ray`` cluster following its Ray cluster: nodes that join, nodes that leave.

Protocol of ``step(cluster, given, log)`` (the ``Follower`` actor runs it every
``ray.follow_s`` seconds, holding ``follow.lock`` in the cluster's directory):

1. Resolve the spec as given against the live Ray nodes (``ray_nodes.resolve``).
2. A node of the running spec whose Ray node is gone (it left, or died) is failed
   over as ``th failover NODE`` does (``scale.Operator.failover``: its runners start
   again elsewhere; its agent, already gone with the node, is reported ``gone`` with
   the copies the hub listed for it), then dropped from the running spec.
3. A live Ray node the running spec lacks is added to it and gets an agent, started
   as ``th up`` starts one (``cluster.agent_args``), recorded in ``state.json``.

The running spec (``spec.yaml``) is rewritten before an agent starts and after a node
is dropped, so ``th status``, ``th scale`` and ``connect`` see the nodes the cluster
has. A node whose hub node left is not failed over: without the hub there is nothing
to fail over to (``th status`` shows the hub down; ``th up`` restarts it elsewhere
only if the spec's ``hub.node`` allows). Each action is one ``log`` line.
"""

from __future__ import annotations

import fcntl
import contextlib
from pathlib import Path

import yaml

from ..spec import ClusterSpec, load
from .state import cluster_dir, read_state, read_token, write_state

LOCK = "follow.lock"


def given_spec(text: str) -> ClusterSpec:
    """The spec as the user wrote it, from its YAML text (the Follower gets it so)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        return load(f.name)
    finally:
        Path(f.name).unlink(missing_ok=True)


def write_spec(spec: ClusterSpec, path: Path) -> None:
    """``spec`` as YAML at ``path`` (atomically): what ``load`` reads back."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False))
    tmp.replace(path)


@contextlib.contextmanager
def locked(cluster: str):
    with open(cluster_dir(cluster) / LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def step(cluster: str, given: ClusterSpec, log) -> None:
    from . import scale
    from .cluster import agent_args
    from .ray_launcher import RayLauncher
    from .ray_nodes import RAY_NODE_ID, resolve

    with locked(cluster):
        state = read_state(cluster)
        if state is None:
            return  # the cluster is going down
        d = cluster_dir(cluster)
        running = load(d / "spec.yaml")
        launcher = RayLauncher(running, d)
        now = resolve(given, launcher.ray.nodes())
        live_ids = {n.spec.labels[RAY_NODE_ID] for n in now.nodes()}
        hub_node = running.hub.node
        for node in running.nodes():
            if node.spec.labels.get(RAY_NODE_ID) in live_ids:
                continue
            if node.name == hub_node:
                log(f"node {node.name} (the hub's) left the Ray cluster: not failed over; `th status`")
                continue
            log(f"node {node.name} left the Ray cluster: failing it over")
            try:
                outcome = scale.run(cluster, state, lambda op, n=node.name: op.failover(n, None), log=log)
                log(f"failed over {node.name}: {outcome.as_dict()}")
            except scale.ScaleError as exc:
                log(f"failover of {node.name}: {exc}")
            state = read_state(cluster) or state
            running = _without(running, node.name)
            write_spec(running, d / "spec.yaml")
        known = {n.spec.labels.get(RAY_NODE_ID) for n in running.nodes()}
        joined = [n for n in now.nodes() if n.spec.labels[RAY_NODE_ID] not in known]
        if not joined:
            return
        running = _with(running, joined)
        write_spec(running, d / "spec.yaml")
        launcher.spec = running
        token = read_token(cluster)
        for node in joined:
            rec = launcher.start(running.node(node.name), "agent", "tensorhub_cli.agent",
                                 agent_args(running, state, launcher, running.node(node.name), token))
            state.procs.append(rec)
            write_state(state)
            log(f"node {node.name} ({node.spec.address}, {node.rack}/{node.dc}) joined: agent started "
                f"(pid {rec.pid})")


def _without(spec: ClusterSpec, name: str) -> ClusterSpec:
    doc = spec.model_dump(mode="json", exclude_none=True)
    for dc in doc["topology"]["datacenters"]:
        for rack in dc["racks"]:
            rack["nodes"] = [n for n in rack["nodes"] if n["name"] != name]
        dc["racks"] = [r for r in dc["racks"] if r["nodes"]]
    doc["topology"]["datacenters"] = [dc for dc in doc["topology"]["datacenters"] if dc["racks"]]
    return ClusterSpec.model_validate(doc)


def _with(spec: ClusterSpec, nodes) -> ClusterSpec:
    """``spec`` with ``nodes`` (placed) added to their racks (made where missing)."""
    doc = spec.model_dump(mode="json", exclude_none=True)
    dcs = doc["topology"]["datacenters"]
    for node in nodes:
        dc = next((x for x in dcs if x["name"] == node.dc), None)
        if dc is None:
            dc = {"name": node.dc, "racks": []}
            dcs.append(dc)
        rack = next((r for r in dc["racks"] if r["name"] == node.rack), None)
        if rack is None:
            rack = {"name": node.rack, "nodes": []}
            dc["racks"].append(rack)
        rack["nodes"] = [n for n in rack["nodes"] if n["name"] != node.name] + [
            node.spec.model_dump(mode="json", exclude_none=True)]
    return ClusterSpec.model_validate(doc)
