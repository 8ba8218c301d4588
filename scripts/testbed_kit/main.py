"""``scripts/testbed up N [...] | down | status``: a cluster of network namespaces on
this machine, with shaped links and a real sshd per node (run as root).

Protocol of ``up``: validate the flags → refuse if a testbed exists → install sshd if
missing → record each namespace in ``testbed.json`` *before* making it → build the
fabric → keys → one sshd per node → known_hosts → the cluster YAML → one check
transfer per link class. Any failure runs ``down`` and exits 1 with the reason.
``down`` stops the recorded sshd PIDs (which takes every process of that node with
it) and deletes every ``thtb-`` namespace; it is idempotent and safe after a
half-finished ``up``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import check, fabric as fab, net, nodes

def testbed_dir() -> Path:
    return Path(os.environ.get("TH_TESTBED_DIR", "/run/th-testbed"))


def _state_path() -> Path:
    return testbed_dir() / "testbed.json"


def read_state() -> dict | None:
    try:
        return json.loads(_state_path().read_text())
    except FileNotFoundError:
        return None


def _write_state(state: dict) -> None:
    tmp = _state_path().with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, _state_path())


def _yaml(doc, indent: int = 0) -> str:
    """A small YAML writer (block style), so the script needs only the stdlib."""
    pad = "  " * indent
    if isinstance(doc, dict):
        lines = []
        for k, v in doc.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{k}:\n{_yaml(v, indent + 1)}")
            else:
                lines.append(f"{pad}{k}: {json.dumps(v)}")
        return "\n".join(lines)
    lines = []
    for item in doc:
        body = _yaml(item, indent + 1).lstrip() if isinstance(item, (dict, list)) else json.dumps(item)
        lines.append(f"{pad}- {body}")
    return "\n".join(lines)


def _python() -> str:
    # The interpreter running this: `th bench` runs it with its own (``bench.testbed.kit``),
    # scripts/testbed with TH_PYTHON, else the repo's .venv: the nodes run what we run.
    return sys.executable


def up(args) -> dict:
    spec = fab.build(args.nodes, args.racks or args.dcs, args.dcs, args.node_gbps * 1000,
                     args.rack_gbps * 1000 if args.rack_gbps else None, args.dc_gbps * 1000 if args.dc_gbps else None)
    if os.geteuid() != 0:
        raise SystemExit("testbed: must run as root (it creates network namespaces)")
    for tool in ("ip", "tc", "unshare"):
        if not shutil.which(tool):
            raise SystemExit(f"testbed: `{tool}` is missing (Debian: iproute2, util-linux)")
    old = read_state()
    if old is not None or net.existing_namespaces():
        raise SystemExit("testbed: one is already up (or half-built); run `scripts/testbed down` first")
    nodes.ensure_openssh()
    d = testbed_dir()
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    state = {"dir": str(d), "args": vars(args), "netns": [], "host_links": [], "sshd": [],
             "nodes": [], "rates_mbit": spec.rates_mbit}

    def record(kind: str, name: str) -> None:
        state[kind if kind == "netns" else "host_links"].append(name)
        _write_state(state)

    _write_state(state)
    try:
        net.build(spec, record)
        client_key = d / "id_ed25519"
        authorized = d / "authorized_keys"
        authorized.write_text(nodes.keygen(client_key, "tensorhub-testbed") + "\n")
        known = []
        for node in spec.nodes:
            node_dir = d / node.name
            node_dir.mkdir(exist_ok=True)
            nodes.keygen(node_dir / "host_ed25519", f"host-{node.name}")
            rec = nodes.start_sshd(node, node_dir, authorized)
            state["sshd"].append(rec)
            _write_state(state)
            known.append(nodes.known_hosts_line(node, node_dir))
            state["nodes"].append({"name": node.name, "address": node.address, "rack": node.rack, "dc": node.dc,
                                   "ns": node.ns, "sshd_pid": rec["pid"]})
        (d / "known_hosts").write_text("\n".join(known) + "\n")
        doc = fab.cluster_doc(spec, args.name, str(client_key), str(d / "known_hosts"), args.python or _python())
        if args.dc_rtt_ms and "links" in doc["topology"]:
            for link in doc["topology"]["links"]:
                link["rtt_ms"] = args.dc_rtt_ms
        cluster = d / "cluster.yaml"
        cluster.write_text(f"# written by scripts/testbed up {args.nodes}: matches the namespaces it built\n"
                           + _yaml(doc) + "\n")
        state["cluster_yaml"] = str(cluster)
        state["links"] = [{"kind": lk.kind, "a_ns": lk.a_ns, "a_if": lk.a_if, "b_ns": lk.b_ns, "b_if": lk.b_if,
                           "mbit": lk.mbit} for lk in spec.links]
        state["check"] = [] if args.no_check else check.measure(spec)
        _write_state(state)
    except BaseException:
        down()
        raise
    return state


def down() -> list[str]:
    """Stop recorded sshds, delete namespaces and host links; report what was removed."""
    state = read_state() or {}
    done = []
    for rec in state.get("sshd", []):
        done.append(f"sshd {rec['node']} (pid {rec['pid']}): {nodes.stop_sshd(rec)}")
    removed = net.remove(state.get("netns", []), state.get("host_links", [fab.HOST_IFACE]) or [fab.HOST_IFACE])
    done += [f"removed {name}" for name in removed]
    # Keys stay (a node keeps its host key across ups, as a machine would); the spec
    # and known_hosts describe nodes that no longer exist.
    for stale in ("cluster.yaml", "known_hosts"):
        (testbed_dir() / stale).unlink(missing_ok=True)
    _state_path().unlink(missing_ok=True)
    return done


def enter(node: str, cwd: str | None = None) -> list[str]:
    """The argv prefix that runs a command inside testbed node ``node``, in ``cwd``
    (default: ours; entering the mount namespace would otherwise leave it at /)."""
    state = read_state()
    if state is None:
        raise SystemExit("testbed: none is up")
    rec = next((r for r in state["sshd"] if r["node"] == node), None)
    if rec is None or nodes.starttime(rec["pid"]) != rec["starttime"]:
        raise SystemExit(f"testbed: node {node!r} is not running (nodes: "
                         f"{', '.join(r['node'] for r in state['sshd'])})")
    return ["nsenter", f"--target={rec['pid']}", "--net", "--pid", "--uts", "--mount", f"--wd={cwd or os.getcwd()}",
            "--"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/testbed", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="build N nodes")
    u.add_argument("nodes", type=int, metavar="N")
    u.add_argument("--racks", type=int, default=0, help="default: one per DC")
    u.add_argument("--dcs", type=int, default=1)
    u.add_argument("--node-gbps", type=float, default=0.5, help="each node's link (default 0.5, see README)")
    u.add_argument("--rack-gbps", type=float, default=None, help="each rack uplink (default 2 × node)")
    u.add_argument("--dc-gbps", type=float, default=None, help="each DC link (default = node)")
    u.add_argument("--dc-rtt-ms", type=float, default=0.0,
                   help="written into the spec's DC links; not emulated (this kernel has no netem)")
    u.add_argument("--name", default="testbed", help="cluster name in the YAML")
    u.add_argument("--python", default=None, help="python on the nodes (default: the one running this)")
    u.add_argument("--no-check", action="store_true", help="skip the check transfers")
    u.add_argument("--json", action="store_true", help="print the state as JSON")
    e = sub.add_parser("exec", help="run a command inside a node (its network, PID, UTS and mount namespaces)")
    e.add_argument("node")
    e.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("down", help="remove everything up made")
    sub.add_parser("status", help="print the recorded state as JSON")
    args = ap.parse_args(argv)
    if args.cmd == "down":
        for line in down():
            print(line)
        print("testbed: down")
        return 0
    if args.cmd == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            raise SystemExit("testbed exec: give a command after the node name")
        argv = enter(args.node) + command
        os.execvp(argv[0], argv)
    if args.cmd == "status":
        state = read_state()
        print(json.dumps(state, indent=2) if state else "testbed: none is up")
        return 0 if state else 1
    try:
        state = up(args)
    except (fab.FabricError, net.NetError, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"testbed: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, fab.FabricError) else 1
    if args.json:
        print(json.dumps(state))
        return 0
    for n in state["nodes"]:
        print(f"{n['name']:<5} {n['address']:<12} {n['rack']:<7} {n['dc']:<5} sshd pid {n['sshd_pid']}")
    for row in state["check"]:
        print(f"link {row['link']:<5} {row['achieved_mbit']:7.0f} Mbit/s of {row['expect_mbit']:.0f} "
              f"({row['achieved_mbit'] / row['expect_mbit']:.0%}; {row['streams']} stream(s) {row['path']})")
    print(f"cluster spec: {state['cluster_yaml']}")
    return 0
