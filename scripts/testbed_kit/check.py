"""Measure the shaping instead of assuming it: one check transfer per link class.

- node: one stream between two nodes of a rack (bottleneck: the node links);
- duplex: those two nodes send to each other at once (each link then carries data
  one way and the other stream's ACKs the other: what every relaying reader does);
- rack: enough streams from one rack to another to exceed the rack uplink rate;
- dc: enough streams from one DC to another to exceed the DC link rate.

Each class reports achieved Mbit/s against the rate the path should allow.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from .fabric import Fabric

PROBE = str(Path(__file__).with_name("probe.py"))
PORT = 5201


def _streams(fabric: Fabric, pairs: list[tuple[str, str]], expect_mbit: float) -> float:
    """Run one stream per (sender, receiver) pair at once; aggregate Mbit/s."""
    nbytes = max(8 << 20, int(expect_mbit * 1e6 / 8 / len(pairs)))  # about one second
    receivers, senders = [], []
    try:
        for i, (_, dst) in enumerate(pairs):
            node = fabric.node(dst)
            proc = subprocess.Popen(["ip", "netns", "exec", node.ns, sys.executable, PROBE, "recv", node.address,
                                     str(PORT + i)], stdout=subprocess.PIPE, text=True)
            receivers.append(proc)
        for proc in receivers:
            if proc.stdout.readline().strip() != "listening":
                raise RuntimeError("check transfer: a receiver did not start")
        for i, (src, dst) in enumerate(pairs):
            senders.append(subprocess.Popen(["ip", "netns", "exec", fabric.node(src).ns, sys.executable, PROBE, "send",
                                             fabric.node(dst).address, str(PORT + i), str(nbytes)]))
        for proc in senders:
            if proc.wait(timeout=90) != 0:
                raise RuntimeError(f"check transfer: a sender failed ({proc.returncode})")
        results = [json.loads(proc.communicate(timeout=90)[0]) for proc in receivers]
    finally:
        for proc in receivers + senders:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    return sum(r["bytes"] for r in results) * 8 / span / 1e6


def measure(fabric: Fabric) -> list[dict]:
    rates = fabric.rates_mbit
    rows = []
    racks = list(fabric.racks.values())
    rack_nodes = next((r for r in racks if len(r) >= 2), None)
    if rack_nodes:
        got = _streams(fabric, [(rack_nodes[0], rack_nodes[1])], rates["node"])
        rows.append({"link": "node", "path": f"{rack_nodes[0]}->{rack_nodes[1]}", "streams": 1,
                     "expect_mbit": rates["node"], "achieved_mbit": got})
        a, b = rack_nodes[0], rack_nodes[1]
        got = _streams(fabric, [(a, b), (b, a)], 2 * rates["node"])
        rows.append({"link": "duplex", "path": f"{a}<->{b}", "streams": 2, "expect_mbit": 2 * rates["node"],
                     "achieved_mbit": got})
    dcs = list(fabric.dcs.values())
    same_dc = next((rs for rs in dcs if len(rs) >= 2), None)
    if same_dc:
        a, b = fabric.racks[same_dc[0]], fabric.racks[same_dc[1]]
        rows.append(_across(fabric, "rack", a, b, rates["rack"]))
    if len(dcs) >= 2:
        a, b = fabric.racks[dcs[0][0]], fabric.racks[dcs[1][0]]
        rows.append(_across(fabric, "dc", a, b, min(rates["dc"], rates["rack"])))
    return rows


def _across(fabric: Fabric, kind: str, senders: list[str], receivers: list[str], limit: float) -> dict:
    node = fabric.rates_mbit["node"]
    k = min(len(senders), len(receivers), math.floor(limit / node) + 1)
    pairs = list(zip(senders[:k], receivers[:k]))
    expect = min(k * node, limit)
    got = _streams(fabric, pairs, expect)
    return {"link": kind, "path": ", ".join(f"{s}->{r}" for s, r in pairs), "streams": k,
            "expect_mbit": expect, "achieved_mbit": got}
