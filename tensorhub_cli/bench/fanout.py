"""`th bench fanout`: one publisher, N readers fetching the same version at once, three
ways in one run: ours (ROS planner: readers relay to each other), trainer-star (every
reader reads from the publisher, same endpoints and engine) and a gloo broadcast of the
same bytes between the same nodes (what a user would otherwise run).

Endpoint arms (ours, star): per planner, one hub, one publisher and max(N) reader
processes are started once. Warm-up (unless ``warmup=False``): every reader first
fetches one untimed version into the destination the timed rows reuse, so the rows hold
no first-fetch cost (registering the destination, connecting to peers), as in a running
rollout, whose destination stays registered and whose peers stay connected. Each row
publishes a fresh version, tells the first N readers to fetch at the same moment, and
takes the time until the last of them has every chunk verified (bit for bit against the
payload rebuilt from the version). Replicas are unpublished between rows, outside the
timing.

Broadcast arm (``bench.broadcast``): max(N)+1 gloo ranks, rank 0 on the publisher's
node, rank k on the k-th reader's node. Per row the first N+1 ranks form a group, warm
it up with one untimed broadcast, then time one broadcast of the payload as one flat
int32 tensor from rank 0: from rank 0's call to the last rank's return. Every rank
checks its bytes against the payload and reports their CRC-32; a mismatch fails the run.
gloo's broadcast is a binomial tree of whole-payload sends (log2(N+1) rounds, no
pipelining), the baseline's nature, not a flaw of the harness.

On loopback there is no link rate, so rows carry no ``bound_s``: the ratio that matters
is N readers vs one. With ``--testbed`` a testbed of max(N)+1 nodes in 2 racks is built
for the run and torn down after it, even on failure: hub, publisher and rank 0 on n1,
readers on the other nodes interleaved over both racks, and every row carries
``bound_s`` = S / node link rate, the time one copy needs through one node's link, and
``chain_bound_s`` = S/B + (N-1)·c/B, what a pipelined chain of chunks c reaches. Rows
also carry the CPU seconds the endpoint processes spent (``ours_endpoint_cpu_s``) and
that divided by this machine's cores (``ours_cpu_floor_s``): on a small machine hosting
every node, CPU and not the links can be what bounds a fan-out. ``raw_socket`` is a
plain TCP stream of the payload from n1 to the first reader (``bench.rawsock``: one
``sendall``, ``recv_into`` one buffer), the median of ``RAW_STREAMS`` run one after
another, and each row's ``ours_cpu_vs_raw_socket`` our processes' CPU per GiB received
over that stream's (both ends) per GiB.
Up to 15 readers (16 nodes): on the 2-core, 24 GiB machine this was built on, a
16-node testbed comes up and its link checks hold (see ``MAX_TESTBED_READERS``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from ..hub.mustering import MUSTER_S
from ..launch.procs import stop_child
from .rig import Driven, RigError, free_port, hub
from .testbed import Site, testbed

MAX_TESTBED_READERS = 15
RACKS = 2
BROADCAST_PORT = 29517  # rank 0's store inside n1 (a fresh namespace: surely free)
TIMEOUT_S = 900.0


def reader_order(state: dict) -> list[str]:
    """Testbed reader nodes (every node but n1), alternating racks: 3 readers already
    span both."""
    racks: dict[str, list[str]] = {}
    for n in state["nodes"]:
        if n["name"] != "n1":
            racks.setdefault(n["rack"], []).append(n["name"])
    columns = list(racks.values())
    return [col[i] for i in range(max(map(len, columns))) for col in columns if i < len(col)]


def _versions(readers: list[int], warmup: bool) -> dict[int, int]:
    """Readers → the version (also the payload's seed) of that row, in every arm; the
    warm-up takes version 1."""
    first = 2 if warmup else 1
    return {n: first + i for i, n in enumerate(readers)}


def _round(pub: Driven, peers: list[Driven], site: Site, version: int, mib: float, chunk_mib: float,
           window: int) -> tuple[float, int, float]:
    """Publish ``version``, every peer fetches it at once → (seconds until the last has
    it verified, bytes n1 sent meanwhile); then everyone unpublishes it."""
    pub.ask("publish", model="fan", version=version, mib=mib, chunk_mib=chunk_mib, timeout=300)
    before, cpu = site.sent("n1"), _cpu_seconds([pub, *peers])
    t0 = time.monotonic()
    for p in peers:
        p.send("fetch", model="fan", version=version, window=window, timeout=TIMEOUT_S, check=False)
    results = [p.recv(TIMEOUT_S + 60) for p in peers]
    for p, res in zip(peers, results):
        if res.get("error"):
            raise RuntimeError(f"{p.name}: version {version}: {res['error']}")
    took, sent = max(r["t_done"] for r in results) - t0, site.sent("n1") - before
    cpu = _cpu_seconds([pub, *peers]) - cpu  # (until every answer is in: a little past the last t_done)
    for p in peers:  # (checked after the CPU is counted: rebuilding the payload is the bench's work)
        if not p.ask("check", version=version, timeout=120).get("equal"):
            raise RuntimeError(f"{p.name}: version {version}: bytes differ")
    for p in peers:
        p.ask("unpublish", model="fan", version=version, timeout=120)
    pub.ask("unpublish", model="fan", version=version, timeout=120)
    return took, sent, cpu


def _rows(planner: str, readers: list[int], mib: float, chunk_mib: float, window: int, engine: str,
          site: Site, names: list[str], warmup: bool) -> tuple[dict[int, float], dict[int, int], dict[int, float]]:
    """→ (readers → seconds, readers → bytes the publisher's node sent (testbed only),
    readers → CPU seconds the endpoint processes spent meanwhile)."""
    out: dict[int, float] = {}
    sent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    versions = _versions(readers, warmup)
    with hub(planner=planner, host=site.address("n1"), prefix=site.prefix("n1")) as (address, token):
        args = ["--hub", address, "--token", token, "--engine", engine]

        def peer(name: str, node: str) -> Driven:
            return Driven(name, ["-m", "tensorhub_cli.bench.peer", "--name", name, *args, *site.place(node)],
                          prefix=site.prefix(node))

        pub = peer("publisher", "n1")
        peers = [peer(f"reader-{node}", node) for node in names[:max(readers)]]
        try:
            for p in peers:
                p.ask("prepare", mib=mib, timeout=300)
            if warmup:
                _round(pub, peers, site, 1, mib, chunk_mib, window)
            for n in readers:
                out[n], sent[n], cpu[n] = _round(pub, peers[:n], site, versions[n], mib, chunk_mib, window)
        finally:
            for p in [*peers, pub]:
                p.stop()
    return out, sent, cpu


def _cpu_seconds(procs: list[Driven]) -> float:
    """User + system CPU seconds the processes (and their children: a testbed process
    runs under ``nsenter``) have used so far. On a small machine the endpoints' CPU, not
    the links, can be what bounds a fan-out: the rows report it beside the times."""
    total = 0.0
    for d in procs:
        try:
            root = psutil.Process(d.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                t = proc.cpu_times()
                total += t.user + t.system
        except psutil.Error:  # (gone between the listing and the read)
            continue
    return total


def _broadcast_rows(readers: list[int], mib: float, site: Site, names: list[str],
                    warmup: bool) -> tuple[dict[int, float], dict[int, int], dict[int, int]]:
    """→ (readers → seconds, readers → bytes n1 sent, readers → CRC-32 every rank held)."""
    nodes = ["n1", *names[:max(readers)]]
    port = BROADCAST_PORT if site.state else free_port()
    init = f"tcp://{site.address('n1')}:{port}"
    env = {"GLOO_SOCKET_IFNAME": "eth0" if site.state else "lo"}
    ranks = [Driven(f"broadcast-rank{r}-{node}", ["-m", "tensorhub_cli.bench.broadcast", "--rank", str(r),
                                                  "--world", str(len(nodes)), "--init", init, "--mib", str(mib),
                                                  "--timeout-s", str(TIMEOUT_S)], env=env, prefix=site.prefix(node))
             for r, node in enumerate(nodes)]
    out: dict[int, float] = {}
    sent: dict[int, int] = {}
    crcs: dict[int, int] = {}
    try:
        for r in ranks:
            r.hello  # noqa: B018 (all joined the group: names the one that did not)
        for n, version in _versions(readers, warmup).items():
            for r in ranks:  # (forming a group is collective over all ranks, members or not)
                r.send("join", members=n + 1, timeout=TIMEOUT_S)
            for r in ranks:
                _answer(r, r.recv(TIMEOUT_S + 60))
            group = ranks[:n + 1]
            before = site.sent("n1")
            for r in group:
                r.send("broadcast", seed=version)
            results = [_answer(r, r.recv(TIMEOUT_S + 60)) for r in group]
            sent[n] = site.sent("n1") - before
            for r, res in zip(group, results):
                if not res["equal"] or res["crc32"] != results[0]["crc32"]:
                    raise RuntimeError(f"{r.name}: broadcast of version {version}: bytes differ from the payload")
            out[n] = max(res["t_done"] for res in results) - results[0]["t0"]
            crcs[n] = results[0]["crc32"]
    finally:
        for r in ranks:
            r.stop()
    return out, sent, crcs


def _answer(proc: Driven, reply: dict) -> dict:
    if reply.get("error"):
        raise RigError(f"{proc.name}: {reply['error']}")
    return reply


def _nbytes(mib: float) -> int:
    return int(mib * 2**20) // 16 * 16


def run(readers: list[int], mib: float = 128, chunk_mib: float = 8, window: int = 2, engine: str = "nixl",
        warmup: bool = True) -> dict:
    names = [f"reader{i}" for i in range(max(readers))]
    ours, _, _ = _rows("ros", readers, mib, chunk_mib, window, engine, Site(), names, warmup)
    star, _, _ = _rows("star", readers, mib, chunk_mib, window, engine, Site(), names, warmup)
    bcast, _, crcs = _broadcast_rows(readers, mib, Site(), names, warmup)
    versions = _versions(readers, warmup)
    one = ours[min(readers)]
    rows = [{"readers": n, "version": versions[n], "ours_s": ours[n], "star_s": star[n], "broadcast_s": bcast[n],
             "ours_vs_one_reader": ours[n] / one, "star_vs_ours": star[n] / ours[n],
             "broadcast_vs_ours": bcast[n] / ours[n], "broadcast_crc32": crcs[n]} for n in readers]
    most = max(readers)
    return {"workload": "fanout", "bytes": _nbytes(mib), "chunk_bytes": int(chunk_mib * 2**20),
            "window": window, "engine": engine, "warmup": warmup, "protocol": _protocol(), "heads": "serial",
            "muster_s": MUSTER_S, "fragments": _fragments(),
            "rows": rows,
            "target": {"max_readers_vs_one": 2.0},
            "target_met": ours[most] / one <= 2.0}


def run_testbed(readers: list[int], mib: float = 128, chunk_mib: float = 4, window: int = 4, engine: str = "nixl",
                node_gbps: float | None = None, warmup: bool = True) -> dict:
    if max(readers) > MAX_TESTBED_READERS:
        raise ValueError(f"--readers: the testbed carries {MAX_TESTBED_READERS} readers at most "
                         f"({MAX_TESTBED_READERS + 1} nodes), got {max(readers)}")
    nodes = max(readers) + 1
    flags = ["--racks", str(min(RACKS, nodes))] + (["--node-gbps", str(node_gbps)] if node_gbps else [])
    with testbed(nodes, *flags) as state:
        site, names = Site(state), reader_order(state)
        ours, ours_sent, ours_cpu = _rows("ros", readers, mib, chunk_mib, window, engine, site, names, warmup)
        star, star_sent, star_cpu = _rows("star", readers, mib, chunk_mib, window, engine, site, names, warmup)
        bcast, bcast_sent, crcs = _broadcast_rows(readers, mib, site, names, warmup)
        raw = _raw_stream(_nbytes(mib), site, names[0])
    nbytes = _nbytes(mib)
    gib = nbytes / 2**30
    versions = _versions(readers, warmup)
    bound = nbytes * 8 / (state["rates_mbit"]["node"] * 1e6)
    step = int(chunk_mib * 2**20) * 8 / (state["rates_mbit"]["node"] * 1e6)
    cores = len(os.sched_getaffinity(0))
    rows = [{"readers": n, "version": versions[n], "ours_s": ours[n], "star_s": star[n], "broadcast_s": bcast[n],
             "bound_s": bound, "chain_bound_s": bound + (n - 1) * step, "ours_vs_bound": ours[n] / bound,
             # what the endpoints' CPU alone allows on this machine's cores, at best
             "ours_endpoint_cpu_s": ours_cpu[n], "ours_cpu_floor_s": ours_cpu[n] / cores,
             # every process's CPU per GiB received, against one raw TCP stream's (both ends) on n1's link
             "ours_cpu_s_per_gib": ours_cpu[n] / (n * gib),
             "ours_cpu_vs_raw_socket": ours_cpu[n] / (n * gib) / raw["cpu_s_per_gib"],
             "star_endpoint_cpu_s": star_cpu[n], "star_vs_bound": star[n] / bound,
             "broadcast_vs_bound": bcast[n] / bound, "star_vs_ours": star[n] / ours[n],
             "broadcast_vs_ours": bcast[n] / ours[n], "broadcast_crc32": crcs[n],
             # what n1's link carried, in copies of the payload (headers included)
             "ours_publisher_copies": ours_sent[n] / nbytes, "star_publisher_copies": star_sent[n] / nbytes,
             "broadcast_publisher_copies": bcast_sent[n] / nbytes}
            for n in readers]
    most = max(readers)
    target = {"ours_vs_bound_at_most_readers": 1.25, "star_vs_ours_at_most_readers": 5.0,
              "broadcast_vs_ours_at_most_readers": 1.0}
    met = {"ours_within_1.25x_bound_at_most_readers": ours[most] / bound <= 1.25,
           "star_vs_ours_at_most_readers_5x": star[most] / ours[most] >= 5.0,
           "ours_no_slower_than_broadcast_at_most_readers": bcast[most] / ours[most] >= 1.0}
    return {"workload": "fanout", "testbed": {"nodes": nodes, "racks": min(RACKS, nodes),
                                              "rates_mbit": state["rates_mbit"], "check": state["check"]},
            "bytes": nbytes, "chunk_bytes": int(chunk_mib * 2**20), "window": window, "engine": engine,
            "warmup": warmup, "protocol": _protocol(), "heads": "serial", "muster_s": MUSTER_S,
            "fragments": _fragments(), "raw_socket": raw,
            "rows": rows,
            "target": target,
            "target_met": all(met.values()), "targets": met}


RAW_STREAMS = 3


def _raw_stream(nbytes: int, site: Site, reader: str, streams: int = RAW_STREAMS) -> dict:
    """``streams`` TCP streams of the payload's size from n1 to ``reader``, one after
    another (``bench.rawsock``): the CPU both ends spend per GiB, the floor of what moving
    bytes costs here. One stream of 128 MiB costs about 0.1 CPU-s, which the kernel's
    accounting resolves to within tens of percent (0.79 to 1.39 CPU-s per GiB in runs of
    one day), so the result is the stream of median CPU, with every stream's figure in
    ``streams_cpu_s_per_gib``."""
    runs = sorted((_one_stream(nbytes, site, reader) for _ in range(streams)), key=lambda r: r["cpu_s_per_gib"])
    return {**runs[len(runs) // 2], "streams_cpu_s_per_gib": [r["cpu_s_per_gib"] for r in runs]}


def _one_stream(nbytes: int, site: Site, reader: str) -> dict:
    port = BROADCAST_PORT + 1 if site.state else free_port()
    argv = ["-m", "tensorhub_cli.bench.rawsock"]
    common = ["--port", str(port), "--nbytes", str(nbytes), "--timeout-s", str(TIMEOUT_S)]
    rx = subprocess.Popen([*(site.prefix(reader) or []), sys.executable, *argv, "recv", *common],
                          stdout=subprocess.PIPE, text=True)
    try:
        tx = subprocess.run([*(site.prefix("n1") or []), sys.executable, *argv, "send", "--address",
                             site.address(reader), "--seed", "1", *common],
                            capture_output=True, text=True, timeout=TIMEOUT_S + 60, check=True)
        out, _ = rx.communicate(timeout=TIMEOUT_S)
    finally:
        stop_child(rx)
    if rx.returncode:
        raise RuntimeError(f"raw stream to {reader}: the receiver failed (exit {rx.returncode}; its stderr above)")
    sent, got = json.loads(tx.stdout), json.loads(out)
    if got["nbytes"] != nbytes or got["crc32"] != sent["crc32"]:
        raise RuntimeError(f"raw stream to {reader}: {got['nbytes']} bytes, crc32 {got['crc32']:#x} "
                           f"against {nbytes}, {sent['crc32']:#x} sent")
    cpu = sent["cpu_s"] + got["cpu_s"]
    return {"reader": reader, "seconds": got["seconds"], "sender_cpu_s": sent["cpu_s"], "receiver_cpu_s": got["cpu_s"],
            "cpu_s_per_gib": cpu / (nbytes / 2**30)}


# "heads": "serial" says a chain head read one chunk at a time (``Planned.serial``),
# "muster_s" how long the hub mustered a new swarm's first plans (``rig.hub`` starts it
# with ``--muster-s MUSTER_S``), "fragments" the reads per relayed chunk
# (``endpoint.scheduled.fragments``): the calibration models files without them with heads
# reading their whole window, plans answered as they came and whole chunks relayed.


def _fragments() -> int:
    """Reads per relayed chunk the readers used (their ``TH_RELAY_FRAGMENTS``, inherited)."""
    from ..endpoint.scheduled import fragments  # (the endpoint's imports, only when a file is written)

    return fragments() if _protocol() == "schedule" else 1


def _protocol() -> str:
    """How the readers fetched (the endpoints' default, or TH_FETCH): the simulator's
    calibration models the file with the same reader (``fetch.protocol``)."""
    return "window" if os.environ.get("TH_FETCH", "schedule") == "window" else "schedule"
