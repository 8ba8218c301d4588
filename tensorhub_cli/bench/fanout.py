"""`th bench fanout`: one publisher, N readers fetching the same version at once; ours
(ROS planner: readers relay to each other) vs the trainer-star planner (everyone reads
from the publisher), in one run.

Per planner, one hub, one publisher and max(N) reader processes are started once;
each row publishes a fresh version, tells the first N readers to fetch at the same
moment, and takes the time until the last of them has every chunk verified. Replicas
are unpublished between rows, outside the timing.

On loopback there is no link rate, so rows carry no ``bound_s``: the ratio that
matters is N readers vs one. With ``--testbed`` an 8-node testbed (2 racks) is built
for the run and torn down after it, even on failure: the hub and publisher run on n1,
readers on the other nodes (interleaved over both racks), and every row carries
``bound_s`` = S / node link rate, the time one copy needs through one node's link.
"""

from __future__ import annotations

import time

from .rig import Driven, hub
from .testbed import Site, testbed

# Reader order on the testbed: alternate racks, so 3 readers already span both.
TESTBED_READERS = ["n2", "n5", "n3", "n6", "n4", "n7", "n8"]


def _rows(planner: str, readers: list[int], mib: float, chunk_mib: float, window: int, engine: str,
          site: Site, names: list[str]) -> tuple[dict[int, float], dict[int, int]]:
    """→ (readers → seconds, readers → bytes the publisher's node sent; testbed only)."""
    out: dict[int, float] = {}
    sent: dict[int, int] = {}
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
            for version, n in enumerate(readers, start=1):
                pub.ask("publish", model="fan", version=version, mib=mib, chunk_mib=chunk_mib, timeout=300)
                before = site.sent("n1")
                t0 = time.monotonic()
                for p in peers[:n]:
                    p.send("fetch", model="fan", version=version, window=window, timeout=900)
                results = [p.recv(960) for p in peers[:n]]
                for p, res in zip(peers, results):
                    if res.get("error") or not res.get("equal"):
                        raise RuntimeError(f"{p.name}: {res.get('error') or 'bytes differ'}")
                out[n] = max(r["t_done"] for r in results) - t0
                sent[n] = site.sent("n1") - before
                for p in peers[:n]:
                    p.ask("unpublish", model="fan", version=version, timeout=120)
                pub.ask("unpublish", model="fan", version=version, timeout=120)
        finally:
            for p in [*peers, pub]:
                p.stop()
    return out, sent


def run(readers: list[int], mib: float = 128, chunk_mib: float = 8, window: int = 2, engine: str = "nixl") -> dict:
    names = [f"reader{i}" for i in range(max(readers))]
    ours, _ = _rows("ros", readers, mib, chunk_mib, window, engine, Site(), names)
    star, _ = _rows("star", readers, mib, chunk_mib, window, engine, Site(), names)
    one = ours[min(readers)]
    rows = [{"readers": n, "ours_s": ours[n], "star_s": star[n], "ours_vs_one_reader": ours[n] / one,
             "star_vs_ours": star[n] / ours[n]} for n in readers]
    most = max(readers)
    return {"workload": "fanout", "bytes": int(mib * 2**20) // 16 * 16, "chunk_bytes": int(chunk_mib * 2**20),
            "window": window, "engine": engine, "rows": rows,
            "target": {"max_readers_vs_one": 2.0},
            "target_met": ours[most] / one <= 2.0}


def run_testbed(readers: list[int], mib: float = 128, chunk_mib: float = 4, window: int = 4, engine: str = "nixl",
                node_gbps: float | None = None) -> dict:
    if max(readers) > len(TESTBED_READERS):
        raise ValueError(f"--readers: the 8-node testbed has {len(TESTBED_READERS)} readers at most")
    flags = ["--racks", "2"] + (["--node-gbps", str(node_gbps)] if node_gbps else [])
    with testbed(8, *flags) as state:
        site = Site(state)
        ours, ours_sent = _rows("ros", readers, mib, chunk_mib, window, engine, site, TESTBED_READERS)
        star, star_sent = _rows("star", readers, mib, chunk_mib, window, engine, site, TESTBED_READERS)
    nbytes = int(mib * 2**20) // 16 * 16
    node_mbit = state["rates_mbit"]["node"]
    bound = nbytes * 8 / (node_mbit * 1e6)
    rows = [{"readers": n, "ours_s": ours[n], "star_s": star[n], "bound_s": bound, "ours_vs_bound": ours[n] / bound,
             "star_vs_bound": star[n] / bound, "star_vs_ours": star[n] / ours[n],
             # what n1's link carried, in copies of the payload (headers included)
             "ours_publisher_copies": ours_sent[n] / nbytes, "star_publisher_copies": star_sent[n] / nbytes}
            for n in readers]
    most = max(readers)
    met = {"ours_within_1.25x_bound": all(r["ours_vs_bound"] <= 1.25 for r in rows),
           "star_vs_ours_at_most_readers_5x": star[most] / ours[most] >= 5.0}
    return {"workload": "fanout", "testbed": {"nodes": 8, "racks": 2, "rates_mbit": state["rates_mbit"],
                                              "check": state["check"]},
            "bytes": nbytes, "chunk_bytes": int(chunk_mib * 2**20), "window": window, "engine": engine,
            "rows": rows, "target": {"ours_vs_bound": 1.25, "star_vs_ours_at_most_readers": 5.0},
            "target_met": all(met.values()), "targets": met}
