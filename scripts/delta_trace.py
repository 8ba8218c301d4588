#!/usr/bin/env python3
"""A real delta trace: which bf16 elements change between consecutive RL-like versions.

Protocol. ``train`` builds a small transformers Llama from a config (no downloads),
warms it up at a pre-training rate (untraced), then, per learning rate, trains it
``--steps`` steps with a fresh AdamW at that rate and publishes a bf16 version after
every step, as a trainer with mixed precision does: the optimizer steps fp32 master
weights and each version is their bf16 cast. Each version is compared with the one
before it, element by element (bit patterns): the changed share per step, per tensor
class (attention, mlp, norm, embed), and how far the changed elements moved in bf16
units in the last place (ulps). The trace is written as JSON (the measurements file
format of docs/measurements/README.md); with ``--keep DIR`` every version's bf16
weights are saved there too (safetensors, one file per version: never in git), for
``codecs``.

``codecs DIR`` chunks every kept version as a publisher does
(``tensorhub_cli.layout.chunking.lay_out``) and encodes each chunk of v+1 against v's
with every method of ``tensorhub_cli.delta.codec``: bytes per version against the full
version, and encode/decode throughput in this process (pin it to one core:
``taskset -c 1``).

The corpus is shipped by Python itself: the source of a fixed list of standard-library
modules, read as bytes and tokenized byte-level (vocabulary 256); the trace records
each file's size and XXH3 so that a rerun can tell whether its corpus differs.

    taskset -c 1 python scripts/delta_trace.py train --keep /tmp/delta-trace \
        --out docs/measurements/delta-trace-llama-DATE.json
    taskset -c 1 python scripts/delta_trace.py codecs /tmp/delta-trace \
        --out docs/measurements/delta-codecs-llama-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tensorhub_cli.delta.trace import CLASSES, tensor_class

CORPUS_MODULES = ("argparse", "difflib", "textwrap", "string", "json.decoder", "json.encoder", "email.message",
                  "http.client", "logging.__init__", "collections.__init__")
def corpus() -> tuple[bytes, list[dict]]:
    import importlib.util

    import xxhash

    parts, files = [], []
    for mod in CORPUS_MODULES:
        base, _, leaf = mod.rpartition(".")
        spec = importlib.util.find_spec(base if leaf == "__init__" else mod)
        data = Path(spec.origin).read_bytes()
        parts.append(data)
        files.append({"module": mod, "bytes": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data)})
    return b"\n".join(parts), files


def build_model(hidden: int, layers: int, seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 16 * 16,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=seq,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float(), cfg


def batches(data: bytes, seq: int, batch: int, seed: int):
    import torch

    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([tokens[s:s + seq] for s in starts.tolist()])


def bf16_version(model) -> dict:
    return {n: p.detach().to("cpu").bfloat16().clone() for n, p in model.named_parameters()}


def compare(old: dict, new: dict) -> dict:
    """Changed share per class and the ulp distance of the changed elements."""
    import torch

    per = {c: [0, 0] for c in CLASSES}
    ulps = {"1": 0, "2": 0, "3-4": 0, "5+": 0, "sign": 0}
    for name, a in old.items():
        ia, ib = a.view(torch.int16).int(), new[name].view(torch.int16).int()
        diff = ia != ib
        c = per[tensor_class(name)]
        c[0] += int(diff.sum())
        c[1] += a.numel()
        if not diff.any():
            continue
        # bf16 is sign-magnitude: between same-signed values the bit patterns' distance
        # is the distance in ulps.
        sa, sb = ia[diff], ib[diff]
        same = (sa < 0) == (sb < 0)
        d = (sa[same] - sb[same]).abs()
        ulps["sign"] += int((~same).sum())
        ulps["1"] += int((d == 1).sum())
        ulps["2"] += int((d == 2).sum())
        ulps["3-4"] += int(((d >= 3) & (d <= 4)).sum())
        ulps["5+"] += int((d >= 5).sum())
    changed = sum(c[0] for c in per.values())
    total = sum(c[1] for c in per.values())
    return {"changed_share": changed / total,
            "by_class": {k: (c[0] / c[1] if c[1] else None) for k, c in per.items()},
            "ulps": {k: (v / changed if changed else 0.0) for k, v in ulps.items()}}


def train(args) -> dict:
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    data, files = corpus()
    model, cfg = build_model(args.hidden, args.layers, args.seq)
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    params = sum(p.numel() for p in model.parameters())

    def run(lr: float, steps: int, seed: int, label: str | None):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
        prev = bf16_version(model)
        if label and args.keep:
            save_file(prev, str(Path(args.keep) / f"{label}-v000.safetensors"))
        rows = []
        for step, x in zip(range(1, steps + 1), batches(data, args.seq, args.batch, seed)):
            t0 = time.perf_counter()
            out = model(input_ids=x, labels=x).loss
            out.backward()
            loss = float(out.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if label is None:
                continue
            cur = bf16_version(model)
            if args.keep:
                save_file(cur, str(Path(args.keep) / f"{label}-v{step:03d}.safetensors"))
            rows.append({"step": step, "loss": round(loss, 4), "seconds": round(time.perf_counter() - t0, 3),
                         **compare(prev, cur)})
            prev = cur
            print(f"{label} step {step}: loss {loss:.3f} changed {rows[-1]['changed_share']:.4f}",
                  file=sys.stderr)
        return rows

    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    run(args.warmup_lr, args.warmup_steps, seed=1, label=None)
    warm = {n: p.detach().clone() for n, p in model.state_dict().items()}
    runs = []
    for i, lr in enumerate(args.lr):
        model.load_state_dict(warm)  # every rate starts from the same warmed-up weights
        steps = run(lr, args.steps, seed=2 + i, label=f"lr{lr:g}")
        shares = [s["changed_share"] for s in steps]
        runs.append({"lr": lr, "label": f"lr{lr:g}", "steps": steps,
                     "changed_share": {"mean": sum(shares) / len(shares), "max": max(shares),
                                       "mean_after_first": sum(shares[1:]) / max(1, len(shares) - 1)}})
    return {"workload": "delta-trace",
            "model": {"kind": "LlamaForCausalLM", "params": params, "bf16_bytes": params * 2,
                      "config": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                              "num_hidden_layers", "num_attention_heads",
                                                              "num_key_value_heads", "tie_word_embeddings")},
                      "shapes": shapes},
            "training": {"precision": "fp32 master weights, each version their bf16 cast",
                         "optimizer": "torch.optim.AdamW", "weight_decay": args.weight_decay,
                         "warmup": {"lr": args.warmup_lr, "steps": args.warmup_steps},
                         "seq": args.seq, "batch": args.batch, "threads": args.threads, "torch": torch.__version__},
            "corpus": {"what": "Python standard-library sources, byte-level tokens", "python": sys.version.split()[0],
                       "files": files, "bytes": len(data)},
            "runs": runs}


def codecs(args) -> dict:
    import numpy as np
    from safetensors.torch import load_file

    from tensorhub_cli.delta import codec
    from tensorhub_cli.layout.chunking import lay_out

    def chunks(path: Path) -> list[np.ndarray]:
        sd = load_file(str(path))
        _, placed = lay_out(sd, chunk_bytes=args.chunk_kib << 10, small_bytes=args.small_kib << 10)
        return [v.numpy().copy() for v in placed.views]

    by_label: dict[str, list[Path]] = {}
    for path in sorted(Path(args.weights).glob("*-v*.safetensors")):
        by_label.setdefault(path.name.rsplit("-v", 1)[0], []).append(path)
    if not by_label:
        raise SystemExit(f"codecs: {args.weights} holds no *-vNNN.safetensors (run `train --keep` first)")
    try:  # a reference only, not a dependency: XOR with lz4 instead of zstd
        import lz4.frame as lz4f
    except ImportError:
        lz4f = None

    def lz4_xor(old, new, level):
        x = np.bitwise_xor(old.view(np.uint16), new.view(np.uint16))
        d = lz4f.compress(codec._planes(x), compression_level=0)
        return d if len(d) < new.nbytes else None

    def lz4_unxor(old, d):
        x = codec._unplanes(lz4f.decompress(d), np.dtype("<u2"), old.nbytes // 2)
        return (old.view(np.uint16) ^ x).tobytes()

    coders = {m: (lambda o, n, lv, m=m: codec.encode(o, n, method=m, level=lv), codec.decode) for m in codec.METHODS}
    if lz4f is not None:
        coders["xor-lz4 (reference)"] = (lz4_xor, lz4_unxor)
    out = []
    for label, paths in by_label.items():
        methods = {m: {"delta_bytes": [], "enc_s": 0.0, "dec_s": 0.0, "full_chunks": 0} for m in coders}
        full_bytes, prev = 0, chunks(paths[0])
        for path in paths[1:]:
            cur = chunks(path)
            full = sum(c.nbytes for c in cur)
            full_bytes += full
            for m, acc in methods.items():
                sent = 0
                for old, new in zip(prev, cur):
                    t0 = time.perf_counter()
                    d = coders[m][0](old, new, args.level)
                    t1 = time.perf_counter()
                    if d is None:
                        acc["full_chunks"] += 1
                        sent += new.nbytes
                        continue
                    back = coders[m][1](old, d)
                    t2 = time.perf_counter()
                    if back != new.tobytes():
                        raise SystemExit(f"codecs: {m} rebuilt a chunk of {path.name} wrong")
                    acc["enc_s"] += t1 - t0
                    acc["dec_s"] += t2 - t1
                    sent += len(d)
                acc["delta_bytes"].append(sent)
            prev = cur
        n = len(paths) - 1
        per_version = full_bytes / n
        out.append({"label": label, "versions": n, "full_bytes_per_version": per_version,
                    "chunks_per_version": len(prev), "methods": {
                        m: {"bytes_ratio": sum(a["delta_bytes"]) / full_bytes,
                            "bytes_ratio_max": max(b / per_version for b in a["delta_bytes"]),
                            "bytes_ratio_by_version": [round(b / per_version, 5) for b in a["delta_bytes"]],
                            "full_chunks": a["full_chunks"],
                            "encode_mbps": full_bytes * 8 / 1e6 / a["enc_s"] if a["enc_s"] else None,
                            "decode_mbps": full_bytes * 8 / 1e6 / a["dec_s"] if a["dec_s"] else None}
                        for m, a in methods.items()}})
    return {"workload": "delta-codecs", "chunk_kib": args.chunk_kib, "small_kib": args.small_kib,
            "level": args.level, "cpus": sorted(os.sched_getaffinity(0)),
            "note": "throughput in Mbit/s of full (rebuilt) chunk bytes, timed in this process", "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train and trace")
    t.add_argument("--hidden", type=int, default=384)
    t.add_argument("--layers", type=int, default=6)
    t.add_argument("--seq", type=int, default=128)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--steps", type=int, default=40)
    t.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    t.add_argument("--warmup-lr", type=float, default=1e-3)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--keep", metavar="DIR", help="save every version's bf16 weights here (not in git)")
    t.add_argument("--out", metavar="FILE.json", required=True)
    c = sub.add_parser("codecs", help="measure the delta codecs over kept versions")
    c.add_argument("weights", metavar="DIR")
    c.add_argument("--chunk-kib", type=int, default=1024)
    c.add_argument("--small-kib", type=int, default=64)
    c.add_argument("--level", type=int, default=1)
    c.add_argument("--out", metavar="FILE.json", required=True)
    args = ap.parse_args()
    result = train(args) if args.cmd == "train" else codecs(args)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    doc = {"command": "python scripts/delta_trace.py " + " ".join(sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "commit": commit, "result": result}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
