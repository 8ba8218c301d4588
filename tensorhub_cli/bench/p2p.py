"""`th bench p2p`: one fetch through our endpoint vs raw NIXL READ vs a raw TCP socket,
between the same two processes on loopback, in one run.

Each method moves the same ``mib`` MiB from the holder's memory into the same
pre-touched destination, ``reps`` times, interleaved (ours, raw NIXL, raw TCP, ours,
…) so drift hits all three alike; the median of each is reported. Ours includes
everything a real fetch does: resolve, plans, per-chunk reads, XXH3 verification of
every byte, progress reports. Raw NIXL is one READ of all chunks with no hub and no
checksums; raw TCP is one stream.
"""

from __future__ import annotations

import statistics

from .rig import Driven, hub


def run(mib: float = 256, reps: int = 3, chunk_mib: float = 16, window: int = 4, engine: str = "nixl") -> dict:
    with hub() as (address, token):
        args = ["--hub", address, "--token", token, "--engine", engine]
        holder = Driven("holder", ["-m", "tensorhub_cli.bench.peer", "--name", "holder", *args])
        reader = Driven("reader", ["-m", "tensorhub_cli.bench.peer", "--name", "reader", *args])
        try:
            holder.ask("publish", model="p2p", version=1, mib=mib, chunk_mib=chunk_mib, timeout=300)
            reader.ask("prepare", mib=mib, timeout=300)
            raw = holder.ask("raw_serve", model="p2p", version=1)
            samples: dict[str, list[float]] = {"ours": [], "raw_nixl": [], "raw_tcp": []}
            for _ in range(reps):
                got = reader.ask("fetch", model="p2p", version=1, window=window, timeout=600)
                if not got["equal"]:
                    raise RuntimeError("fetched bytes differ from the published ones")
                samples["ours"].append(got["s"])
                reader.ask("unpublish", model="p2p", version=1, timeout=120)
                nixl = reader.ask("raw_nixl", md=raw["md"], regions=raw["regions"], chunk_mib=chunk_mib, timeout=600)
                if nixl["state"] != "DONE":
                    raise RuntimeError(f"raw NIXL READ ended {nixl['state']}")
                samples["raw_nixl"].append(nixl["s"])
                samples["raw_tcp"].append(reader.ask("raw_tcp", address=raw["tcp"], timeout=600)["s"])
            engine_used = reader.hello["engine"]
        finally:
            reader.stop()
            holder.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    nbytes = int(mib * 2**20) // 16 * 16
    return {
        "workload": "p2p", "bytes": nbytes, "engine": engine_used, "chunk_bytes": int(chunk_mib * 2**20),
        "window": window, "reps": reps,
        "ours_s": med["ours"], "raw_nixl_s": med["raw_nixl"], "raw_tcp_s": med["raw_tcp"],
        "ratio_vs_raw_nixl": med["raw_nixl"] / med["ours"], "ratio_vs_raw_tcp": med["raw_tcp"] / med["ours"],
        "ours_gbps": nbytes * 8 / med["ours"] / 1e9, "samples_s": samples,
        "target": {"ratio_vs_raw_nixl": 0.9}, "target_met": med["raw_nixl"] / med["ours"] >= 0.9,
    }
