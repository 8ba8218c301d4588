"""The simulated cluster's places and links: GPUs on nodes in racks in datacenters.

Protocol: ``Topology(net, dcs=[gpus in dc1, gpus in dc2, ...], fabric)`` lays GPUs out
in order, ``gpus_per_node`` to a node and ``nodes_per_rack`` nodes to a rack, racks
never spanning DCs, and adds their links to ``net``; ``path(a, b)`` is the links a
transfer from GPU ``a`` to GPU ``b`` crosses, ``level(a, b)`` the hub's name for that
distance (node, rack, dc, remote). Every GPU has its own NIC (one link out,
one in) and an NVLink port (out, in) for peers on its node; where sending and receiving
at once costs (``duplex_efficiency``), also a link both directions of the NIC share. A
rack has an uplink each way, a DC one to the WAN each way. Rates are Gbit/s in, bytes/s
on the links, times ``efficiency`` (what a transfer achieves of a link's nominal rate).

A link that can never be a bottleneck (a rack uplink at least as fast as every NIC
below it together: a non-blocking fabric) is left out of paths: it would not change
any max-min share, only the cost of computing them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .network import Network


@dataclass(frozen=True)
class Fabric:
    """How GPUs are packed and linked (rates in Gbit/s, each direction)."""

    gpus_per_node: int
    nodes_per_rack: int
    nic_gbps: float
    nvlink_gbps: float
    rack_uplink_gbps: float | None  # None: non-blocking
    wan_gbps: float | None  # each DC's link to the WAN
    efficiency: float = 1.0
    # What a NIC carries both ways at once, as a share of twice its rate (None: the two
    # directions are independent). On the namespace testbed a relaying node sends and
    # receives through one veth and one CPU, and gets less than each direction alone.
    duplex_efficiency: float | None = None
    uplink_efficiency: float | None = None  # rack and WAN links (None: ``efficiency``)
    # One host runs every node (the namespace testbed): its cores move at most this many
    # bytes per second in all, a link every transfer crosses (None: hosts never bind).
    host_bytes_per_s: float | None = None

    @classmethod
    def of(cls, cluster) -> "Fabric":
        """From ``params.Cluster``."""
        return cls(cluster.gpus_per_node, cluster.nodes_per_rack, cluster.nic_gbps, cluster.nvlink_gbps,
                   cluster.rack_uplink_gbps, cluster.wan_gbps, cluster.link_efficiency)


@dataclass(frozen=True)
class Gpu:
    index: int
    node: str
    rack: str
    dc: str
    nic_out: int
    nic_in: int
    duplex: int | None  # both directions of the NIC together, where that binds
    nv_out: int
    nv_in: int
    rack_no: int
    dc_no: int


def gbps(rate: float, efficiency: float = 1.0) -> float:
    """Gbit/s → bytes/s actually achieved."""
    return rate * 1e9 / 8 * efficiency


class Topology:
    def __init__(self, net: Network, dcs: list[int], fabric: Fabric):
        f = fabric
        gpus_per_node, nodes_per_rack, efficiency = f.gpus_per_node, f.nodes_per_rack, f.efficiency
        rack_uplink_gbps, wan_gbps = f.rack_uplink_gbps, f.wan_gbps
        if not dcs or any(n < 1 for n in dcs):
            raise ValueError(f"every datacenter needs at least one GPU, got {dcs}")
        self.gpus: list[Gpu] = []
        self.rack_up: list[int | None] = []  # per rack: uplink id out of the rack (None: never binds)
        self.rack_down: list[int | None] = []
        self.dc_up: list[int | None] = []  # per DC: its link to the WAN, out and in
        self.dc_down: list[int | None] = []
        nic, nv = gbps(f.nic_gbps, efficiency), gbps(f.nvlink_gbps, efficiency)
        up_eff = efficiency if f.uplink_efficiency is None else f.uplink_efficiency
        both = gbps(2 * f.nic_gbps, f.duplex_efficiency) if f.duplex_efficiency else None
        both = both if both is not None and both < 2 * nic else None
        self.host = net.link(f.host_bytes_per_s) if f.host_bytes_per_s else None
        node_no = rack_no = 0
        for d, count in enumerate(dcs):
            wan = gbps(wan_gbps, up_eff) if wan_gbps and len(dcs) > 1 else None
            self.dc_up.append(net.link(wan) if wan else None)
            self.dc_down.append(net.link(wan) if wan else None)
            placed = 0
            while placed < count:
                in_rack = min(count - placed, gpus_per_node * nodes_per_rack)
                uplink = gbps(rack_uplink_gbps, up_eff) if rack_uplink_gbps else None
                binds = uplink is not None and uplink < in_rack * nic
                self.rack_up.append(net.link(uplink) if binds else None)
                self.rack_down.append(net.link(uplink) if binds else None)
                for k in range(in_rack):
                    if k % gpus_per_node == 0:
                        node_no += 1
                    self.gpus.append(Gpu(len(self.gpus), f"n{node_no}", f"rack{rack_no + 1}", f"dc{d + 1}",
                                         net.link(nic), net.link(nic), net.link(both) if both else None,
                                         net.link(nv), net.link(nv), rack_no, d))
                placed += in_rack
                rack_no += 1

    @staticmethod
    def level(a: Gpu, b: Gpu) -> str:
        """The hub's name for the cheapest level that holds both: node < rack < dc < remote."""
        if a.node == b.node:
            return "node"
        if a.rack_no == b.rack_no:
            return "rack"
        return "dc" if a.dc_no == b.dc_no else "remote"

    def path(self, a: Gpu, b: Gpu) -> tuple[int, ...]:
        if a.node == b.node:
            return (a.nv_out, b.nv_in)
        links = [a.nic_out, a.duplex, b.duplex]
        if a.rack_no != b.rack_no:
            links += [self.rack_up[a.rack_no], self.rack_down[b.rack_no]]
            if a.dc_no != b.dc_no:
                links += [self.dc_up[a.dc_no], self.dc_down[b.dc_no]]
        links += [b.nic_in, self.host]
        return tuple(x for x in links if x is not None)
