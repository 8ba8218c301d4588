"""`th bench fanout`: one publisher, N readers fetching the same version at once, on
loopback; ours (ROS planner: readers relay to each other) vs the trainer-star planner
(everyone reads from the publisher), in one run.

Per planner, one hub, one publisher and max(N) reader processes are started once;
each row publishes a fresh version, tells the first N readers to fetch at the same
moment, and takes the time until the last of them has every chunk verified. Replicas
are unpublished between rows, outside the timing. Loopback has no link rate, so rows
carry no ``bound_s``: the ratio that matters here is N readers vs one.
"""

from __future__ import annotations

import time

from .rig import Driven, hub


def _rows(planner: str, readers: list[int], mib: float, chunk_mib: float, window: int, engine: str) -> dict[int, float]:
    out: dict[int, float] = {}
    with hub(planner=planner) as (address, token):
        args = ["--hub", address, "--token", token, "--engine", engine]
        pub = Driven("publisher", ["-m", "tensorhub_cli.bench.peer", "--name", "publisher", *args])
        peers = [Driven(f"reader{i}", ["-m", "tensorhub_cli.bench.peer", "--name", f"reader{i}", *args])
                 for i in range(max(readers))]
        try:
            for peer in peers:
                peer.ask("prepare", mib=mib, timeout=300)
            for version, n in enumerate(readers, start=1):
                pub.ask("publish", model="fan", version=version, mib=mib, chunk_mib=chunk_mib, timeout=300)
                t0 = time.monotonic()
                for peer in peers[:n]:
                    peer.send("fetch", model="fan", version=version, window=window, timeout=900)
                results = [peer.recv(960) for peer in peers[:n]]
                for peer, res in zip(peers, results):
                    if res.get("error") or not res.get("equal"):
                        raise RuntimeError(f"{peer.name}: {res.get('error') or 'bytes differ'}")
                out[n] = max(r["t_done"] for r in results) - t0
                for peer in peers[:n]:
                    peer.ask("unpublish", model="fan", version=version, timeout=120)
                pub.ask("unpublish", model="fan", version=version, timeout=120)
        finally:
            for peer in [*peers, pub]:
                peer.stop()
    return out


def run(readers: list[int], mib: float = 128, chunk_mib: float = 8, window: int = 2, engine: str = "nixl") -> dict:
    ours = _rows("ros", readers, mib, chunk_mib, window, engine)
    star = _rows("star", readers, mib, chunk_mib, window, engine)
    one = ours[min(readers)]
    rows = [{"readers": n, "ours_s": ours[n], "star_s": star[n], "ours_vs_one_reader": ours[n] / one,
             "star_vs_ours": star[n] / ours[n]} for n in readers]
    most = max(readers)
    return {"workload": "fanout", "bytes": int(mib * 2**20) // 16 * 16, "chunk_bytes": int(chunk_mib * 2**20),
            "window": window, "engine": engine, "rows": rows,
            "target": {"max_readers_vs_one": 2.0},
            "target_met": ours[most] / one <= 2.0}
