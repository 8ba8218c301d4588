"""Build and remove a ``Fabric`` with iproute2 and tc (root only).

Every command runs with a timeout and a failure raises ``NetError`` naming the command
and its stderr. Creation is recorded by the caller before it happens, and removal
works from what exists, so a half-built fabric is always removable.
"""

from __future__ import annotations

import subprocess

from .fabric import HOST_ADDRESS, PREFIX, Fabric, Link


class NetError(RuntimeError):
    pass


def sh(*argv: str, timeout: float = 20.0, check: bool = True) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise NetError(f"`{' '.join(argv)}` did not finish within {timeout:.0f}s") from None
    except FileNotFoundError:
        raise NetError(f"`{argv[0]}` is not installed (needed: iproute2)") from None
    if check and done.returncode != 0:
        raise NetError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _ip(ns: str | None, *args: str) -> None:
    sh("ip", *(["-n", ns] if ns else []), *args)


def existing_namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-")]


def add_namespace(ns: str) -> None:
    sh("ip", "netns", "add", ns)
    _ip(ns, "link", "set", "lo", "up")
    # No IPv6: its router and neighbour chatter would pollute the link byte counters.
    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
       "net.ipv6.conf.default.disable_ipv6=1")


def add_bridge(ns: str) -> None:
    _ip(ns, "link", "add", "br0", "type", "bridge")
    _ip(ns, "link", "set", "br0", "up")


def _shape(ns: str | None, dev: str, mbit: float) -> None:
    # tbf: the bucket must hold at least one GSO super-packet (64 KiB) and ~4 ms of
    # traffic, or the achieved rate falls well below the configured one. The queue
    # is shallow (5 ms), as a switch port's is: with 100 ms of FIFO a link carrying
    # data one way queued the other direction's ACKs behind it, and two nodes
    # sending to each other at once got 72 % of the rate each way instead of 92 %.
    burst = max(96 * 1024, int(mbit * 1e6 / 8 * 0.004))
    sh("tc", *(["-n", ns] if ns else []), "qdisc", "replace", "dev", dev, "root", "tbf",
       "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "5ms")


def add_link(link: Link, address: str | None = None) -> None:
    """Create the veth pair, bridge its ends, shape both directions and bring it up.
    ``address`` (CIDR) goes on the ``a`` end (a node's eth0, or the host end)."""
    a_side = ["netns", link.a_ns] if link.a_ns else []
    sh("ip", "link", "add", "name", link.a_if, *a_side, "type", "veth", "peer", "name", link.b_if,
       "netns", link.b_ns)
    for ns, dev, bridged in ((link.a_ns, link.a_if, link.a_bridge), (link.b_ns, link.b_if, link.b_bridge)):
        if bridged:
            _ip(ns, "link", "set", "dev", dev, "master", "br0")
        if link.mbit:
            _shape(ns, dev, link.mbit)
        _ip(ns, "link", "set", "dev", dev, "up")
    if address:
        _ip(link.a_ns, "addr", "add", address, "dev", link.a_if)


def build(fabric: Fabric, record) -> None:
    """``record(kind, name)`` is called before each namespace or host link is made."""
    for ns in fabric.namespaces:
        record("netns", ns)
        add_namespace(ns)
    for ns in fabric.bridges:
        add_bridge(ns)
    by_ns = {n.ns: n for n in fabric.nodes}
    for link in fabric.links:
        if link.a_ns is None:
            record("host_link", link.a_if)
            add_link(link, f"{HOST_ADDRESS}/16")
        else:
            node = by_ns.get(link.a_ns) if link.kind == "node" else None
            add_link(link, f"{node.address}/16" if node else None)


def remove(namespaces: list[str], host_links: list[str]) -> list[str]:
    """Delete what exists of these (and of any other ``thtb-`` namespace); returns what
    was removed. Deleting a namespace deletes the veth ends inside it, and so their peers."""
    removed = []
    for ns in sorted(set(namespaces) | set(existing_namespaces())):
        if ns in existing_namespaces():
            sh("ip", "netns", "del", ns)
            removed.append(ns)
    for dev in host_links:
        # Usually gone already with its peer's namespace; the kernel may still be at it.
        if sh("ip", "link", "show", "dev", dev, check=False):
            sh("ip", "link", "del", "dev", dev, check=False)
            if sh("ip", "link", "show", "dev", dev, check=False):
                raise NetError(f"could not delete host interface {dev}")
            removed.append(dev)
    return removed


def counters(ns: str | None, dev: str) -> dict[str, int]:
    """The kernel's byte counters of one interface (tx/rx as seen from that end)."""
    base = f"/sys/class/net/{dev}/statistics"
    if ns is None:
        read = lambda what: int(open(f"{base}/{what}").read())  # noqa: E731
        return {"tx_bytes": read("tx_bytes"), "rx_bytes": read("rx_bytes")}
    out = sh("ip", "netns", "exec", ns, "cat", f"{base}/tx_bytes", f"{base}/rx_bytes")
    tx, rx = (int(x) for x in out.split())
    return {"tx_bytes": tx, "rx_bytes": rx}


def set_link(ns: str, dev: str, up: bool) -> None:
    _ip(ns, "link", "set", "dev", dev, "up" if up else "down")
