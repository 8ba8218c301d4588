"""A real endpoint process for tests, driven by JSON lines on stdin (one reply line each).

``python -m tests.integration.worker --hub ADDR --token T --name N [--engine nixl|tcp]``.
Tensors are made from a seed, so any process can rebuild the exact bytes to compare.
``corrupt`` is the test hook that flips one byte of a chunk this endpoint holds.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback

import torch

from tensorhub_cli import connect
from tensorhub_cli.bench.peer import arguments, connect_from


def make(seed: int, mib: float, small: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = int(mib * 2**20) // 4 // 4
    sd = {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(4)}
    for i in range(small):  # compacted into shared chunks
        sd[f"layer{i}.bias"] = torch.randn(257 + i, generator=g)
    sd["step"] = torch.tensor([seed], dtype=torch.int64)
    return sd


def stepped(seed: int, mib: float, step: int, share: float) -> dict[str, torch.Tensor]:
    """``make(seed, mib)`` after ``step`` training-like steps: each flips the lowest
    mantissa bit of about ``share`` of every weight's elements (what a small update does
    to most changed elements), so consecutive steps differ sparsely (deltas)."""
    sd = make(seed, mib)
    for k in range(1, step + 1):
        g = torch.Generator().manual_seed(seed * 1000 + k)
        for t in sd.values():
            if t.dtype == torch.float32:
                t.view(torch.int32).bitwise_xor_((torch.rand(t.shape, generator=g) < share).to(torch.int32))
    return sd


def _tensors(c: dict) -> dict[str, torch.Tensor]:
    if "step" in c:
        return stepped(c["seed"], c["mib"], c["step"], c.get("share", 0.02))
    return make(c["seed"], c["mib"])


def main() -> int:
    ap = arguments()
    ap.add_argument("--cluster", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.cluster:
        ep = connect(cluster=args.cluster, name=args.name, node=args.node, role="rollout")
    else:
        ep = connect_from(args, heartbeat_s=0.2)
    tensors: dict = {}
    print(json.dumps({"ready": True, "engine": ep.engine.kind}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply = handle(ep, tensors, op, cmd)
        except Exception as exc:
            reply = {"error": str(exc), "type": type(exc).__name__, "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
        if op == "exit":
            break
    return 0


def handle(ep, tensors: dict, op: str, c: dict) -> dict:
    key = (c.get("model"), c.get("version"))
    if op == "publish":
        sd = tensors[key] = _tensors(c)
        m = ep.publish(c["model"], c["version"], sd, chunk_bytes=int(c.get("chunk_mib", 4) * 2**20))
        return {"chunks": len(m.chunks)}
    if op == "fetch":
        want = _tensors(c)
        dst = {k: torch.zeros_like(v) for k, v in want.items()}
        before = {k: v.clone() for k, v in dst.items()}
        try:
            version = ep.fetch(c["model"], c.get("version", "latest"), into=dst, timeout=c.get("timeout", 60),
                               window=c.get("window", 4))
        except Exception as exc:
            unchanged = all(torch.equal(before[k], dst[k]) for k in dst)
            return {"error": str(exc), "type": type(exc).__name__, "unchanged": unchanged}
        tensors[(c["model"], version)] = dst
        return {"version": version, "t_done": time.monotonic(), "stats": ep.last_fetch,
                "equal": all(torch.equal(want[k], dst[k]) for k in want)}
    if op == "fetch_into_wrong":
        want = make(c["seed"], c["mib"])
        dst = {k: torch.zeros_like(v) for k, v in want.items()}
        dst["layer0.weight"] = torch.zeros(7, dtype=torch.float32)
        dst["layer1.weight"] = dst["layer1.weight"].to(torch.float64)
        before = {k: v.clone() for k, v in dst.items()}
        try:
            ep.fetch(c["model"], "latest", into=dst, timeout=10)
        except Exception as exc:
            return {"error": str(exc), "type": type(exc).__name__,
                    "unchanged": all(torch.equal(before[k], dst[k]) for k in dst)}
        return {"error": None}
    if op == "corrupt":
        view = ep.replicas.get(key).placed.views[c["chunk"]]
        view[0] = (int(view[0]) + 1) % 256
        return {"corrupted": c["chunk"]}
    if op == "unpublish":
        ep.unpublish(c["model"], c["version"], timeout=c.get("timeout", 30))
        return {"t_done": time.monotonic()}
    if op == "overwrite":
        for t in tensors[key].values():
            t.fill_(-1)
        return {"overwritten": True}
    if op == "accept_sync":
        ep.accept_sync(c["model"], lambda shards: tensors.setdefault("sync", _alloc(shards)))
        return {"accepting": c["model"]}
    if op == "compare_file":
        from safetensors.torch import load_file

        want = load_file(c["path"])
        got = tensors.get("sync", {})
        return {"equal": set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)}
    if op == "peer":
        return {"address": ep.peer.address}
    if op == "exit":
        ep.close(drain_timeout=c.get("drain_timeout", 5))
        return {"closed": True}
    raise ValueError(f"unknown op {op}")


def _alloc(shards):
    from tensorhub_cli.layout import allocate

    return allocate(shards)


if __name__ == "__main__":
    sys.exit(main())
