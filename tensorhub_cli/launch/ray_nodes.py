"""A ``launcher: ray`` spec's nodes, as the Ray cluster has them now (pure).

Protocol. ``resolve(given, ray_nodes)`` takes the spec as the user wrote it and the
entries of ``ray.nodes()`` and returns the spec every other part of the launcher
reads (``th up`` writes it as the cluster's ``spec.yaml``): the same spec with a
``topology`` listing each live Ray node and ``hub.node`` set. Per Ray node:

- address: its ``NodeManagerAddress`` (the IP its raylet serves on);
- name: a node of the given ``topology`` with that address names (and places) it;
  else its label ``ray.node_label`` (default ``tensorhub.io/node``); else
  ``ray-<IP with dashes>``, which stays the same when the node rejoins;
- rack and DC: the given node's, else the label ``ray.rack_label`` / ``ray.dc_label``,
  else a custom resource ``LABEL=VALUE`` (``ray start --resources
  '{"tensorhub.io/rack=r1": 1}'``), else ``rack0`` / ``dc0``;
- gpus: its ``GPU`` resource; labels: the given node's, plus ``ray.io/node-id``
  (``RAY_NODE_ID``): how a process inside a Ray worker finds its TensorHub node.

``hub.node`` may name a node or an address; absent, the Ray head. Two live Ray nodes
with one address, or a hub node Ray does not have, are ``RayNodesError``.
"""

from __future__ import annotations

import re
from typing import Iterable

from pydantic import ValidationError

from ..spec import ClusterSpec

RAY_NODE_ID = "ray.io/node-id"  # the label of a resolved node that holds its Ray node id
HEAD_RESOURCE = "node:__internal_head__"
_PLAIN = re.compile(r"[^A-Za-z0-9._-]")


class RayNodesError(Exception):
    pass


def _label(node: dict, key: str) -> str | None:
    value = (node.get("Labels") or {}).get(key)
    if value:
        return value
    for resource in node.get("Resources") or {}:  # a custom resource "KEY=VALUE"
        if resource.startswith(key + "="):
            return resource[len(key) + 1:]
    return None


def _plain(text: str) -> str:
    return _PLAIN.sub("-", text)[:64].strip("-.") or "node"


def live(ray_nodes: Iterable[dict]) -> list[dict]:
    """The live Ray nodes, head first, then by address (a stable order)."""
    alive = [n for n in ray_nodes if n.get("Alive")]
    return sorted(alive, key=lambda n: (HEAD_RESOURCE not in (n.get("Resources") or {}), n["NodeManagerAddress"]))


def resolve(given: ClusterSpec, ray_nodes: Iterable[dict]) -> ClusterSpec:
    if given.launcher != "ray":
        raise RayNodesError(f"spec {given.name!r} has launcher {given.launcher!r}, not 'ray'")
    ray = given.ray_or_default()
    listed = {p.spec.address: p for p in given.nodes()}
    nodes = live(ray_nodes)
    if not nodes:
        raise RayNodesError("the Ray cluster has no live node")
    seen: dict[str, str] = {}
    racks: dict[tuple[str, str], list[dict]] = {}
    dc_order: list[str] = []
    head = None
    for n in nodes:
        address = n["NodeManagerAddress"]
        if address in seen:
            raise RayNodesError(f"Ray nodes {seen[address]} and {n['NodeID']} share the address {address}: give "
                                "each raylet its own (`ray start --node-ip-address`), TensorHub places nodes by it")
        seen[address] = n["NodeID"]
        over = listed.get(address)
        if over is not None:
            doc = over.spec.model_dump(mode="json", exclude_none=True)
            dc, rack = over.dc, over.rack
        else:
            name = _label(n, ray.node_label) or "ray-" + address.replace(".", "-").replace(":", "-")
            doc = {"name": _plain(name), "address": address, "gpus": int((n.get("Resources") or {}).get("GPU", 0))}
            dc = _plain(_label(n, ray.dc_label) or "dc0")
            rack = _plain(_label(n, ray.rack_label) or "rack0")
        doc["labels"] = {**doc.get("labels", {}), RAY_NODE_ID: n["NodeID"]}
        if dc not in dc_order:
            dc_order.append(dc)
        racks.setdefault((dc, rack), []).append(doc)
        if head is None and HEAD_RESOURCE in (n.get("Resources") or {}):
            head = doc["name"]
    datacenters = [{"name": dc, "racks": [{"name": rack, "nodes": docs} for (d, rack), docs in racks.items()
                                          if d == dc]} for dc in dc_order]
    hub_node = given.hub.node
    if hub_node is not None:
        match = [d["name"] for docs in racks.values() for d in docs if hub_node in (d["name"], d["address"])]
        if not match:
            raise RayNodesError(f"hub.node: {hub_node!r} is no live Ray node (by name or address); live: "
                                + ", ".join(f"{d['name']} ({d['address']})" for docs in racks.values() for d in docs))
        hub_node = match[0]
    else:
        hub_node = head or datacenters[0]["racks"][0]["nodes"][0]["name"]
    doc = given.model_dump(mode="json", exclude_none=True)
    doc["hub"]["node"] = hub_node
    old_links = doc.get("topology", {}).get("links", [])
    doc["topology"] = {"datacenters": datacenters,
                       "links": [link for link in old_links if set(link["between"]) <= set(dc_order)]}
    try:
        return ClusterSpec.model_validate(doc)
    except ValidationError as exc:
        raise RayNodesError(f"the Ray cluster's nodes do not make a valid spec: {exc}") from None


def ray_node_id(spec: ClusterSpec, node: str) -> str:
    """The Ray node id of resolved node ``node``."""
    return spec.node(node).spec.labels[RAY_NODE_ID]


def node_of(spec: ClusterSpec, ray_node_id: str):
    """The resolved node whose Ray node id is ``ray_node_id``, or None."""
    return next((n for n in spec.nodes() if n.spec.labels.get(RAY_NODE_ID) == ray_node_id), None)
