"""The testbed's shape as data: which namespaces, links and addresses ``up`` builds.

Pure (no I/O), so the shape is testable without root. One flat /16 (10.77.0.0/16) spans
every namespace, bridged at layer 2; the private range is used only between these
namespaces. The tree, with every link a veth pair shaped in both directions:

    node nsN (eth0) ──node link── rack ns (br0) ──rack uplink── DC ns (br0)
    DC ns ──DC link── core ns (br0)            (only with two or more DCs)
    host (root namespace, ``thtb-host``) ── DC ns of the first DC, unshaped: the operator's
    control path (ssh, ``th status``); it never carries node-to-node bytes.

Addresses: node i (1-based, global) in rack r (1-based, global) is 10.77.r.i; the host
is 10.77.0.254. Names are ``n1`` … ``nN``; racks ``rack1`` …; DCs ``dc1`` ….
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREFIX = "thtb"  # every namespace and host-side interface the testbed makes starts so
SUBNET = "10.77"
HOST_ADDRESS = f"{SUBNET}.0.254"
HOST_IFACE = f"{PREFIX}-host"


class FabricError(ValueError):
    pass


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    rack: str
    dc: str

    @property
    def ns(self) -> str:
        return f"{PREFIX}-{self.name}"


@dataclass(frozen=True)
class Link:
    """A veth pair: ``a_if`` in namespace ``a_ns`` (None = the root namespace) and
    ``b_if`` in ``b_ns``, each end enslaved to its namespace's ``br0`` when
    ``a_bridge``/``b_bridge``. ``mbit`` shapes both directions; None leaves it unshaped."""

    kind: str  # "node", "rack", "dc" or "host"
    a_ns: str | None
    a_if: str
    b_ns: str
    b_if: str
    mbit: float | None
    a_bridge: bool = False
    b_bridge: bool = True


@dataclass
class Fabric:
    nodes: list[Node]
    bridges: list[str]  # namespaces holding a br0
    links: list[Link]
    rates_mbit: dict[str, float]
    racks: dict[str, list[str]] = field(default_factory=dict)  # rack -> node names
    dcs: dict[str, list[str]] = field(default_factory=dict)  # dc -> rack names

    @property
    def namespaces(self) -> list[str]:
        return [n.ns for n in self.nodes] + self.bridges

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def link(self, kind: str, name: str) -> Link:
        """The link of ``kind`` whose lower end belongs to node/rack/DC ``name``."""
        want = {"node": f"{PREFIX}-{name}", "rack": f"{PREFIX}-{name}", "dc": f"{PREFIX}-{name}"}[kind]
        return next(lk for lk in self.links if lk.kind == kind and lk.a_ns == want)


def _split(count: int, parts: int) -> list[int]:
    """``count`` items over ``parts`` bins as evenly as possible, earlier bins first."""
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def build(nodes: int, racks: int = 1, dcs: int = 1, node_mbit: float = 1000, rack_mbit: float | None = None,
          dc_mbit: float | None = None) -> Fabric:
    if not 1 <= nodes <= 200:
        raise FabricError(f"N: nodes must be 1..200, got {nodes}")
    if not 1 <= dcs <= 8:
        raise FabricError(f"--dcs must be 1..8, got {dcs}")
    if racks < dcs:
        raise FabricError(f"--racks ({racks}) must be at least --dcs ({dcs}): every DC needs a rack")
    if racks > nodes:
        raise FabricError(f"--racks ({racks}) must be at most N ({nodes}): every rack needs a node")
    if racks > 250:
        raise FabricError(f"--racks must be at most 250, got {racks}")
    for flag, value in (("--node-gbps", node_mbit), ("--rack-gbps", rack_mbit), ("--dc-gbps", dc_mbit)):
        if value is not None and not value > 0:
            raise FabricError(f"{flag} must be positive, got {value / 1000:g}")
    rack_mbit = rack_mbit or 2 * node_mbit
    dc_mbit = dc_mbit or node_mbit
    fabric = Fabric(nodes=[], bridges=[], links=[], rates_mbit={"node": node_mbit, "rack": rack_mbit})
    if dcs > 1:
        fabric.rates_mbit["dc"] = dc_mbit
    per_rack = _split(nodes, racks)
    racks_per_dc = _split(racks, dcs)
    rack_no = node_no = 0
    for d in range(dcs):
        dc = f"dc{d + 1}"
        dc_ns = f"{PREFIX}-{dc}"
        fabric.bridges.append(dc_ns)
        fabric.dcs[dc] = []
        for _ in range(racks_per_dc[d]):
            rack = f"rack{rack_no + 1}"
            rack_ns = f"{PREFIX}-{rack}"
            fabric.bridges.append(rack_ns)
            fabric.dcs[dc].append(rack)
            fabric.links.append(Link("rack", rack_ns, "uplink", dc_ns, rack, rack_mbit, a_bridge=True))
            fabric.racks[rack] = []
            for _ in range(per_rack[rack_no]):
                node = Node(f"n{node_no + 1}", f"{SUBNET}.{rack_no + 1}.{node_no + 1}", rack, dc)
                fabric.nodes.append(node)
                fabric.racks[rack].append(node.name)
                fabric.links.append(Link("node", node.ns, "eth0", rack_ns, node.name, node_mbit))
                node_no += 1
            rack_no += 1
        if dcs > 1:
            fabric.links.append(Link("dc", dc_ns, "uplink", f"{PREFIX}-core", dc, dc_mbit, a_bridge=True))
    if dcs > 1:
        fabric.bridges.append(f"{PREFIX}-core")
    fabric.links.append(Link("host", None, HOST_IFACE, f"{PREFIX}-dc1", "host", None))
    return fabric


def cluster_doc(fabric: Fabric, name: str, key_file: str, known_hosts: str, python: str,
                heartbeat_s: float = 0.5, expiry_s: float = 3.0) -> dict:
    """The cluster spec (as a YAML-ready dict) that matches what was built."""
    dcs = []
    for dc, racks in fabric.dcs.items():
        dcs.append({"name": dc, "racks": [
            {"name": rack, "nodes": [
                {"name": n, "address": fabric.node(n).address, "nic_gbps": fabric.rates_mbit["node"] / 1000,
                 "bootstrap": {"python": python}} for n in fabric.racks[rack]]}
            for rack in racks]})
    doc = {
        "name": name,
        "launcher": "ssh",
        "engine": "nixl",
        "ssh": {"user": "root", "port": 22, "key_file": key_file, "known_hosts": known_hosts,
                "strict_host_keys": True, "connect_timeout_s": 10},
        "hub": {"node": fabric.nodes[0].name, "port": 7700, "heartbeat_s": heartbeat_s, "expiry_s": expiry_s},
        "topology": {"datacenters": dcs},
        "models": [{"name": "policy", "chunk_mb": 4, "retain": {"keep_latest": 2, "min_reliable_copies": 1}}],
    }
    if "dc" in fabric.rates_mbit:
        names = list(fabric.dcs)
        doc["topology"]["links"] = [{"between": [a, b], "gbps": fabric.rates_mbit["dc"] / 1000}
                                    for i, a in enumerate(names) for b in names[i + 1:]]
    return doc
