"""`th bench delta`: the chunk delta codec on a trained model's shape, on one core.

Protocol. ``run(...)`` reads the stored trace (docs/measurements/delta-trace-*.json,
written by scripts/delta_trace.py; the newest unless ``trace`` names one): the model's
tensor shapes, and for the run at learning rate ``lr`` each step's changed share per
tensor class and how far changed elements moved (ulps). It builds bf16 weights of that
shape (normal, std 0.02, seeded) and, per step, changes that share of each class's
elements by the trace's ulp distances at random positions: a synthetic version with the
trace's statistics (the traced weights themselves are not in git). Each version is
chunked as a publisher chunks it (``layout.chunking.lay_out``) and every chunk of v+1 is
encoded against v's and rebuilt with ``delta.codec.rebuild_verified`` against the chunk's
digest; a chunk whose delta would not be smaller is counted as sent in full. The process
is pinned to one core while it measures. The result, per step: full and delta bytes,
their ratio, encode and rebuild MB/s; top level ``delta.bytes_ratio`` (all delta bytes ÷
all full bytes), ``delta.decode_mbps`` (rebuild rate in Mbit/s of rebuilt chunk bytes:
the WAN's unit) and its margin over ``wan_mbit``, and ``wrong_bytes`` (0: every rebuilt
chunk verified, else the run fails). Raises ``BenchError`` naming what is missing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[2] / "docs" / "measurements"


class BenchError(RuntimeError):
    pass


def load_trace(trace: Path | None = None) -> tuple[Path, dict]:
    if trace is None:
        found = sorted(FOLDER.glob("delta-trace-*.json"))
        if not found:
            raise BenchError(f"no delta trace in {FOLDER} (scripts/delta_trace.py train writes one); name one "
                             "with --trace")
        trace = found[-1]
    try:
        doc = json.loads(Path(trace).read_text())
        result = doc["result"]
        result["model"]["shapes"], result["runs"]  # noqa: B018 (the fields this bench reads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{trace}: not a delta trace ({type(exc).__name__}: {exc})") from None
    return Path(trace), result


def _pick_run(result: dict, lr: float) -> dict:
    for r in result["runs"]:
        if abs(r["lr"] - lr) <= 1e-12 + 1e-6 * abs(lr):
            return r
    known = ", ".join(f"{r['lr']:g}" for r in result["runs"])
    raise BenchError(f"--lr {lr:g}: the trace has runs at {known} only")


def _step_versions(shapes: dict, steps: list[dict], seed: int):
    """(v0, then each step's version) as {name: bf16 tensor} with each step's statistics."""
    import numpy as np
    import torch

    from ..delta.trace import tensor_class

    rng = np.random.default_rng(seed)
    cur = {n: torch.from_numpy((rng.standard_normal(int(np.prod(s)), dtype=np.float32) * 0.02)).bfloat16().reshape(s)
           for n, s in shapes.items()}
    yield cur
    for st in steps:
        ulps = st["ulps"]
        dist = np.array([ulps.get("1", 1.0), ulps.get("2", 0.0), ulps.get("3-4", 0.0), ulps.get("5+", 0.0)])
        dist = dist / dist.sum() if dist.sum() > 0 else np.array([1.0, 0, 0, 0])
        nxt = {}
        for n, t in cur.items():
            share = st["by_class"].get(tensor_class(n)) or 0.0
            bits = t.view(torch.int16).numpy().reshape(-1).copy()
            idx = np.flatnonzero(rng.random(bits.size) < share)
            moves = rng.choice(np.array([1, 2, 3, 6], dtype=np.int16), size=idx.size, p=dist)
            # bf16 is sign-magnitude: adding to the bit pattern moves the magnitude by that
            # many ulps, up or down; weights of std 0.02 stay far from zero and infinity.
            bits[idx] += np.where(rng.random(idx.size) < 0.5, moves, -moves).astype(np.int16)
            nxt[n] = torch.from_numpy(bits).view(torch.bfloat16).reshape(t.shape)
        yield nxt
        cur = nxt


def run(trace: Path | None = None, lr: float = 1e-6, steps: int = 10, chunk_kib: int = 1024, small_kib: int = 64,
        method: str | None = None, level: int | None = None, wan_mbit: float = 100.0, seed: int = 0) -> dict:
    from ..delta import codec
    from ..layout.chunking import lay_out

    method = method or codec.DEFAULT_METHOD
    level = codec.DEFAULT_LEVEL if level is None else level
    if method not in codec.METHODS:
        raise BenchError(f"--method must be one of {', '.join(codec.METHODS)}, got {method!r}")
    path, result = load_trace(trace)
    picked = _pick_run(result, lr)
    traced = picked["steps"][:steps]
    before = os.sched_getaffinity(0)
    core = min(before)
    os.sched_setaffinity(0, {core})  # one core: the rebuild rate one reader thread gets
    try:
        rows, prev = [], None
        for sd in _step_versions(result["model"]["shapes"], traced, seed):
            manifest, placed = lay_out(sd, chunk_bytes=chunk_kib << 10, small_bytes=small_kib << 10, digest="xxh3")
            chunks = [(v.numpy(), m.checksum) for v, m in zip(placed.views, manifest.chunks)]
            if prev is not None:
                rows.append(_one_step(codec, prev, chunks, method, level, len(rows) + 1,
                                      traced[len(rows)]["changed_share"]))
            prev = chunks
    finally:
        os.sched_setaffinity(0, before)
    full = sum(r["full_bytes"] for r in rows)
    sent = sum(r["delta_bytes"] for r in rows)
    enc_s = sum(r["full_bytes"] / (r["encode_mb_s"] * 1e6) for r in rows)
    rebuilt = sum(r["rebuilt_bytes"] for r in rows)
    dec_s = sum(r["rebuilt_bytes"] / (r["decode_mb_s"] * 1e6) for r in rows if r["decode_mb_s"])
    decode_mbps = rebuilt * 8 / 1e6 / dec_s if dec_s else None
    return {"workload": "delta", "trace": path.name, "synthetic": True, "lr": picked["lr"], "method": method,
            "level": level, "chunk_bytes": chunk_kib << 10, "small_bytes": small_kib << 10, "cpu": core,
            "model": {"params": result["model"].get("params"), "tensors": len(result["model"]["shapes"])},
            "steps": rows, "wrong_bytes": 0,
            "delta": {"bytes_ratio": sent / full if full else None, "decode_mbps": decode_mbps,
                      "encode_mbps": full * 8 / 1e6 / enc_s if enc_s else None, "wan_mbit": wan_mbit,
                      "decode_margin": decode_mbps / wan_mbit if decode_mbps else None,
                      "targets": {"bytes_ratio_max": 0.25, "decode_mbps_min": wan_mbit}}}


def _one_step(codec, prev: list, chunks: list, method: str, level: int, step: int, share: float) -> dict:
    full = sent = full_chunks = rebuilt = 0
    enc_s = dec_s = 0.0
    for (old, _), (new, digest) in zip(prev, chunks):
        full += new.nbytes
        t0 = time.perf_counter()
        d = codec.encode(old, new, method=method, level=level)
        t1 = time.perf_counter()
        enc_s += t1 - t0
        if d is None:
            full_chunks += 1
            sent += new.nbytes
            continue
        try:
            codec.rebuild_verified(old, d, digest, "xxh3")
        except codec.DeltaError as exc:
            raise BenchError(f"step {step}: a rebuilt chunk failed verification: {exc}") from None
        dec_s += time.perf_counter() - t1
        sent += len(d)
        rebuilt += new.nbytes
    return {"step": step, "changed_share": share, "full_bytes": full, "delta_bytes": sent,
            "ratio": sent / full, "full_chunks": full_chunks,
            "encode_mb_s": full / 1e6 / enc_s if enc_s else None,
            "rebuilt_bytes": rebuilt, "decode_mb_s": rebuilt / 1e6 / dec_s if dec_s else None}


def render(console, r: dict) -> None:
    from ..ui.tables import Grid

    t = Grid("step", "changed", "full MB", "delta MB", "ratio", "encode MB/s", "rebuild MB/s",
             title=f"delta codec ({r['method']}), lr {r['lr']:g}, one core")
    for s in r["steps"]:
        t.add_row(str(s["step"]), f"{s['changed_share']:.2%}", f"{s['full_bytes'] / 1e6:.1f}",
                  f"{s['delta_bytes'] / 1e6:.2f}", f"{s['ratio']:.3f}", f"{s['encode_mb_s'] or 0:.0f}",
                  f"{s['decode_mb_s'] or 0:.0f}")
    console.print(t)
    d = r["delta"]
    console.print(f"synthetic versions with the changed shares of {r['trace']}.", highlight=False, markup=False)
    console.print(f"bytes ratio {d['bytes_ratio']:.3f} (delta ÷ full, target ≤ 0.25); rebuild "
                  f"{d['decode_mbps'] or 0:.0f} Mbit/s on one core = {d['decode_margin'] or 0:.1f} × the "
                  f"{d['wan_mbit']:g} Mbit/s WAN (target ≥ 1)", highlight=False, markup=False)
