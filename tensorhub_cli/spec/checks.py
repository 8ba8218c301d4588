"""Cross-field checks: what no single field can know on its own.

Each check returns every problem it finds (not just the first), as (path, message)
pairs whose path uses the same keys as the YAML, so the loader can attach line numbers.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from pathlib import Path

from .model import ClusterSpec

Loc = tuple  # path into the YAML document: ("topology", "datacenters", 0, "name")
Problem = tuple[Loc, str]


def _node_locs(spec: ClusterSpec):
    if spec.topology is None:  # launcher 'ray' before its nodes are resolved
        return
    for d, dc in enumerate(spec.topology.datacenters):
        for r, rack in enumerate(dc.racks):
            for n, node in enumerate(rack.nodes):
                yield ("topology", "datacenters", d, "racks", r, "nodes", n), node


def _duplicates(items: list[tuple[Loc, str]], what: str) -> list[Problem]:
    seen = Counter(value for _, value in items)
    return [(loc, f"duplicate {what} {value!r}") for loc, value in items if seen[value] > 1]


def check_names(spec: ClusterSpec) -> list[Problem]:
    nodes = list(_node_locs(spec))
    problems = _duplicates([(loc + ("name",), n.name) for loc, n in nodes], "node name")
    problems += _duplicates([(loc + ("address",), n.address) for loc, n in nodes], "node address")
    datacenters = spec.topology.datacenters if spec.topology else []
    dcs = [(("topology", "datacenters", i, "name"), dc.name) for i, dc in enumerate(datacenters)]
    problems += _duplicates(dcs, "datacenter name")
    for d, dc in enumerate(datacenters):
        racks = [(("topology", "datacenters", d, "racks", r, "name"), rk.name) for r, rk in enumerate(dc.racks)]
        problems += _duplicates(racks, f"rack name in datacenter {dc.name!r}")
    models = [(("models", i, "name"), m.name) for i, m in enumerate(spec.models)]
    problems += _duplicates(models, "model name")
    return problems


def check_references(spec: ClusterSpec) -> list[Problem]:
    names = {n.name for _, n in _node_locs(spec)}
    problems: list[Problem] = []
    # With launcher 'ray' the hub's node may name a Ray node not listed (or an address).
    if spec.hub.node is not None and spec.hub.node not in names and spec.launcher != "ray":
        problems.append((("hub", "node"), f"unknown node {spec.hub.node!r}"))
    if spec.hub.metrics_port is not None and spec.hub.metrics_port == spec.hub.port:
        problems.append((("hub", "metrics_port"), "must differ from hub.port"))
    if spec.topology is None:
        return problems
    dcs = {dc.name for dc in spec.topology.datacenters}
    pairs: set[frozenset[str]] = set()
    for i, link in enumerate(spec.topology.links):
        loc = ("topology", "links", i, "between")
        for end in link.between:
            if end not in dcs:
                problems.append((loc, f"unknown datacenter {end!r}"))
        if link.between[0] == link.between[1]:
            problems.append((loc, "a link must join two different datacenters"))
        pair = frozenset(link.between)
        if pair in pairs:
            problems.append((loc, f"second link between {sorted(pair)}"))
        pairs.add(pair)
    if len(dcs) > 1 and spec.launcher != "ray":  # ray: DCs come from node labels; a link is optional
        linked = {end for link in spec.topology.links for end in link.between}
        for i, dc in enumerate(spec.topology.datacenters):
            if dc.name not in linked:
                problems.append(
                    (("topology", "datacenters", i, "name"), f"datacenter {dc.name!r} has no link to any other")
                )
    return problems


def check_roles(spec: ClusterSpec) -> list[Problem]:
    names = {n.name for _, n in _node_locs(spec)}
    problems: list[Problem] = []
    for role_name, role in spec.roles.items():
        loc = ("roles", role_name)
        for j, node in enumerate(role.select.nodes or []):
            if node not in names and spec.launcher != "ray":  # ray: nodes join later
                problems.append((loc + ("select", "nodes", j), f"unknown node {node!r}"))
        if role.count % role.group_size != 0:
            problems.append(
                (loc + ("group_size",), f"group_size {role.group_size} does not divide count {role.count}")
            )
        if role.count > 0 and not select_nodes(spec, role_name) and spec.launcher != "ray":
            problems.append((loc + ("select",), "selects no node, but count > 0"))
    return problems


def check_launcher(spec: ClusterSpec) -> list[Problem]:
    problems: list[Problem] = []
    if spec.launcher == "ray":
        return problems  # nodes, hub node and addresses come from Ray (launch.ray_nodes)
    if spec.topology is None:
        problems.append((("topology",), f"required with launcher {spec.launcher!r} (the nodes it starts on); "
                                        "only launcher 'ray' takes its nodes from the Ray cluster"))
    if spec.hub.node is None:
        problems.append((("hub", "node"), f"required with launcher {spec.launcher!r}: the node that runs the hub"))
    if spec.ray is not None:
        problems.append((("ray",), f"only for launcher 'ray' (this spec has launcher {spec.launcher!r})"))
    if spec.launcher != "local":
        return problems
    for loc, node in _node_locs(spec):
        try:
            loopback = ipaddress.ip_address(node.address).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            problems.append(
                (loc + ("address",), f"launcher 'local' needs a loopback IP (127.x.y.z), got {node.address!r}")
            )
    return problems


def check_files(spec: ClusterSpec, base: Path) -> list[Problem]:
    if spec.auth.token_file is None:
        return []
    path = resolve_path(spec.auth.token_file, base)
    if not path.is_file():
        return [(("auth", "token_file"), f"no such file: {path}")]
    return []


def resolve_path(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path)


def select_nodes(spec: ClusterSpec, role_name: str) -> list[str]:
    """Names of the nodes a role may run on, in spec order."""
    sel = spec.roles[role_name].select
    chosen = []
    for _, node in _node_locs(spec):
        if sel.nodes is not None and node.name not in sel.nodes:
            continue
        if sel.labels and any(node.labels.get(k) != v for k, v in sel.labels.items()):
            continue
        chosen.append(node.name)
    return chosen


ALL_CHECKS = (check_names, check_references, check_roles, check_launcher)


def cross_check(spec: ClusterSpec, base: Path) -> list[Problem]:
    problems: list[Problem] = []
    for check in ALL_CHECKS:
        problems += check(spec)
    problems += check_files(spec, base)
    return problems
