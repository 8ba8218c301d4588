"""A verl trainer or rollout worker for tests: the "tensorhub" checkpoint engine, built
through verl's registry, driven by JSON lines on stdin (one reply line each).

``python -m tests.integration.verl_driver --role trainer|rollout --hub ADDR --token-file F
[--receive-timeout-s S] [--double-buffer] [--name NAME]`` (the last two: engine_kwargs
``double_buffer`` and ``name``). Our module is imported as verl's ``custom_backend_module`` is
(``import_external_libs``), then ``CheckpointEngineRegistry.new("tensorhub", ...)``
gets the keywords verl's workers pass (trainer: ``is_master``, ``bucket_size``;
rollout: ``bucket_size``). Weights are made from a seed, so both sides rebuild the
exact bytes. Ops: ``send`` {step, seed[, gate]}: with ``gate`` the weight stream stops
halfway, touches ``GATE.reached`` and waits (up to 60 s) for the file ``GATE``;
``receive`` {step, seed}: ``step`` may be null (``latest``); the reply says whether the
bytes equal the seed's, the version fetched, where the yielded tensors live (``ptrs``),
the fetch's ``bytes`` and ``from_publishers``, and the endpoint's ``group``; ``exit``.
A rollout started with ``$WG_PREFIX`` set is what verl makes of a rollout replica's
worker (verl sets it per worker group).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import traceback
from pathlib import Path

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs


def make(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(512, 256, generator=g).to(torch.bfloat16),
            "layers.0.mlp.weight": torch.randn(1024, 300, generator=g),
            "layers.0.norm.weight": torch.randn(256, generator=g),
            "lm_head.bias": torch.randint(-2**31, 2**31 - 1, (77,), generator=g, dtype=torch.int32)}


def stream(seed: int, gate: str | None):
    """What verl's ``get_per_tensor_param`` yields: (name, tensor), one at a time."""
    items = list(make(seed).items())
    for i, (name, tensor) in enumerate(items):
        if gate and i == len(items) // 2:
            Path(gate + ".reached").touch()
            deadline = time.monotonic() + 60
            while not Path(gate).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"send gate {gate} not opened within 60s")
                time.sleep(0.01)
        yield name, tensor


async def collect(engine, step: int) -> tuple[dict, list[int]]:
    got, ptrs = {}, []
    async for name, tensor in engine.receive_weights(global_steps=step):
        got[name] = tensor.clone()  # (as a rollout loads them: the staging set stays published)
        ptrs.append(tensor.data_ptr())
    return got, sorted(ptrs)


def handle(engine, op: str, c: dict) -> dict:
    if op == "send":
        metrics = asyncio.run(engine.send_weights(stream(c["seed"], c.get("gate")), global_steps=c["step"]))
        ptrs = sorted(t.data_ptr() for t in engine._sets[1 - engine._next].tensors.values())
        return {"metrics": metrics, "ptrs": ptrs}
    if op == "receive":
        try:
            got, ptrs = asyncio.run(collect(engine, c["step"]))
        except Exception as exc:
            return {"error": str(exc), "type": type(exc).__name__}
        want = make(c["seed"])
        return {"names": list(got), "version": engine.last_receive["version"], "ptrs": ptrs,
                "group": engine._ep[0].info.group,
                "bytes": engine.last_receive["bytes"], "from_publishers": engine.last_receive["from_publishers"],
                "equal": got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)}
    if op == "exit":
        started = time.monotonic()
        engine.close()
        return {"bye": True, "close_s": time.monotonic() - started}
    raise ValueError(f"unknown op {op!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("trainer", "rollout"), required=True)
    ap.add_argument("--hub", required=True)
    ap.add_argument("--token-file", required=True)
    ap.add_argument("--receive-timeout-s", type=float, default=600.0)
    ap.add_argument("--double-buffer", action="store_true")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import_external_libs("tensorhub_cli.adapters.verl")  # as custom_backend_module is imported
    engine_kwargs = dict(hub=args.hub, token_file=args.token_file, model="policy", engine="tcp",
                         receive_timeout_s=args.receive_timeout_s, double_buffer=args.double_buffer, name=args.name)
    verl_kwargs = dict(bucket_size=1 << 20) if args.role == "rollout" else dict(is_master=True, bucket_size=1 << 20)
    engine = CheckpointEngineRegistry.new("tensorhub", **verl_kwargs, **engine_kwargs)
    print(json.dumps({"ready": True, "cls": type(engine).__name__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            reply = handle(engine, op, cmd)
        except Exception as exc:
            reply = {"error": str(exc), "type": type(exc).__name__, "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
        if op == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
