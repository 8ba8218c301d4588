"""`th bench p2p`: one fetch through our endpoint vs raw NIXL READ vs a raw TCP socket,
between the same two processes on loopback, in one run; or, with ``layout="tp2"``, a
TP-2 reader of a Shard(0) x 2 publisher against a same-layout reader, in one run.

``layout="same"``: each method moves the same ``mib`` MiB from the holder's memory into
the same pre-touched destination, ``reps`` times, interleaved (ours, raw NIXL, raw TCP,
ours, …) so drift hits all three alike; the median of each is reported. Ours includes
everything a real fetch does: resolve, plans, per-chunk reads, XXH3 verification of
every byte, progress reports. Raw NIXL is one READ of all chunks with no hub and no
checksums; raw TCP is one stream.

``layout="tp2"``: a Llama-shaped model of about ``mib`` MiB (bf16, random from a seed:
``llama_config``, ``llama_weights``) is published by two publisher processes, rank r
registering rows ``split(out, 2, r)`` of every HF tensor as ``Part``s (1-D ones too).
Two reader processes (TP ranks 0 and 1) then fetch at the same time, per rep, both
layouts in turn (after one untimed round; the order alternates per rep, so drift hits
both alike): ``tp2``, the
rank's vLLM parameters (``layout.vllm_llama.targets``: fused qkv and gate_up, o_proj and
down_proj by columns, norms whole), and ``same``, the rank's own Shard(0) rows of every
tensor (``targets.tp(..., 0, rank, 2)``). Each reader zeroes its destination before
and checks it bit for bit after every fetch (against ``vllm_llama.reference`` and
``torch.chunk`` slices), then unpublishes it; each fetch goes into a fresh destination
(``bench.peer.Peer.fetch_tp`` says why). A layout's time is the median over reps
of the slower rank's wall; bytes are the most a rank read in any rep.
"""

from __future__ import annotations

import statistics

from .rig import Driven, RigError, hub

LAYOUTS = ("same", "tp2")
# Llama shapes (hidden, intermediate, heads, kv heads, vocab), largest first: the
# largest whose embeddings plus one layer fit the size is taken, then layers fill it.
SHAPES = ((1024, 2816, 16, 8, 32000), (512, 1408, 8, 4, 8000), (256, 704, 8, 4, 2000), (64, 176, 4, 2, 512))
DTYPE_BYTES = 2  # bf16


def run(mib: float = 256, reps: int = 3, chunk_mib: float = 16, window: int = 4, engine: str = "nixl",
        layout: str = "same", small_mib: float | None = None, seed: int = 0) -> dict:
    """``small_mib``: tensors below it are packed into shared chunks (None: the
    endpoint's default); only ``tp2`` takes it, and ``seed``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: want one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout == "tp2":
        return run_tp2(mib, reps, chunk_mib, window, engine, small_mib, seed)
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
        "workload": "p2p", "layout": "same", "bytes": nbytes, "engine": engine_used,
        "chunk_bytes": int(chunk_mib * 2**20), "window": window, "reps": reps,
        "ours_s": med["ours"], "raw_nixl_s": med["raw_nixl"], "raw_tcp_s": med["raw_tcp"],
        "ratio_vs_raw_nixl": med["raw_nixl"] / med["ours"], "ratio_vs_raw_tcp": med["raw_tcp"] / med["ours"],
        "ours_gbps": nbytes * 8 / med["ours"] / 1e9, "samples_s": samples,
        "target": {"ratio_vs_raw_nixl": 0.9}, "target_met": med["raw_nixl"] / med["ours"] >= 0.9,
    }


# --- the TP-2 layout ------------------------------------------------------------------

def llama_config(mib: float) -> dict:
    """A Llama config (untied, bf16) of about ``mib`` MiB, at least one layer."""
    if not mib > 0:
        raise ValueError(f"mib: want a positive size, got {mib!r}")
    want = mib * 2**20
    for hidden, inter, heads, kv, vocab in SHAPES:
        fixed = (2 * vocab * hidden + hidden) * DTYPE_BYTES  # embed_tokens, lm_head, the final norm
        layer = (hidden * (hidden + 2 * (hidden // heads) * kv + hidden + 3 * inter) + 2 * hidden) * DTYPE_BYTES
        if fixed + layer <= want:
            break
    return {"hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "num_hidden_layers": max(1, round((want - fixed) / layer)),
            "vocab_size": vocab, "tie_word_embeddings": False}


def llama_weights(config: dict, seed: int) -> dict:
    """Every HF tensor of ``config``, bf16 from ``seed`` (the same in every process)."""
    import types

    import torch

    from ..layout import vllm_llama

    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16)
            for name, shape in vllm_llama.global_shapes(types.SimpleNamespace(**config)).items()}


def _each(procs: list[Driven], op: str, timeout: float, args: list[dict]) -> list[dict]:
    """Ask every process ``op`` at once (its own ``args``), then collect every answer."""
    for proc, a in zip(procs, args):
        proc.send(op, **a)
    replies = [proc.recv(timeout) for proc in procs]
    for proc, reply in zip(procs, replies):
        if reply.get("trace"):
            raise RigError(f"{proc.name}: {op} raised {reply['type']}: {reply['error']}\n{reply['trace']}")
    return replies


def _summary(rows: list[list[dict]]) -> dict:
    ranks = range(len(rows[0]))
    return {"s": statistics.median(max(r["s"] for r in rep) for rep in rows),
            "bytes_per_rank": [max(rep[i]["stats"]["bytes"] for rep in rows) for i in ranks],
            "share_per_rank": [rows[0][i]["share"] for i in ranks],
            "from_publishers_per_rank": [max(rep[i]["stats"]["from_publishers"] for rep in rows) for i in ranks]}


def run_tp2(mib: float, reps: int, chunk_mib: float, window: int, engine: str, small_mib: float | None,
            seed: int) -> dict:
    config, world, model = llama_config(mib), 2, "p2p-tp2"
    rows: dict[str, list[list[dict]]] = {k: [] for k in LAYOUTS}
    with hub() as (address, token):
        args = ["--hub", address, "--token", token, "--engine", engine]
        if small_mib is not None:
            args += ["--small-bytes", str(int(small_mib * 2**20))]
        procs: list[Driven] = []  # appended one by one: a failed start still stops the others
        try:
            for n in ("pub0", "pub1", "tp0", "tp1"):
                procs.append(Driven(n, ["-m", "tensorhub_cli.bench.peer", "--name", n, *args]))
            pubs, readers = procs[:world], procs[world:]
            ranks = [dict(config=config, seed=seed, rank=r, world=world) for r in range(world)]
            published = _each(pubs, "publish_rows", 600, [dict(model=model, version=1, chunk_mib=chunk_mib, **a)
                                                          for a in ranks])
            _each(readers, "prepare_tp", 600, ranks)
            # One untimed (but checked) round first: peer connections and first-use costs
            # would otherwise land on whichever layout goes first.
            for rep in range(-1, reps):
                for layout in (LAYOUTS[::-1] if rep % 2 == 0 else LAYOUTS):  # alternating: rep 0 starts with tp2
                    got = _each(readers, "fetch_tp", 600, [dict(model=model, version=1, layout=layout,
                                                                window=window, timeout=600)] * world)
                    for r, g in enumerate(got):
                        if not g["equal"]:
                            raise RuntimeError(f"{layout} fetch of TP rank {r}: bytes differ from the published "
                                               f"ones in {', '.join(g['mismatched'])}")
                    if rep >= 0:
                        rows[layout].append(got)
                    _each(readers, "unpublish", 120, [dict(model=model, version=1)] * world)
            engine_used = readers[0].hello["engine"]
        finally:
            for proc in reversed(procs):
                proc.stop()
    total = sum(p["bytes"] for p in published)
    tp2, same = _summary(rows["tp2"]), _summary(rows["same"])
    return {
        "workload": "p2p", "layout": "tp2", "bytes": total, "engine": engine_used,
        "chunk_bytes": int(chunk_mib * 2**20), "window": window, "reps": reps, "world": world,
        "model": {**config, "dtype": "bfloat16", "bytes": total},
        "tp2": tp2, "same": same, "time_ratio": same["s"] / tp2["s"],
        "bytes_over_share": max(b / s for b, s in zip(tp2["bytes_per_rank"], tp2["share_per_rank"])),
        "exact": True,  # every fetch of every rep was checked bit for bit (else: RuntimeError above)
        "samples_s": {k: [max(r["s"] for r in rep) for rep in v] for k, v in rows.items()},
    }
