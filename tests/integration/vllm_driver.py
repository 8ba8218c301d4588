"""Processes for ``test_adapter_vllm``: a tiny Llama on disk, a trainer, a real vLLM engine.

Protocol. ``make_model(dir, seed)`` (in the caller's process) writes a random tiny Llama
(config, safetensors, a ``tokenizers`` tokenizer) that vLLM's CPU build runs.
``python -m tests.integration.vllm_driver trainer|engine ARGS`` is a child that reads one
JSON command per stdin line and answers each with one stdout line ``@th <json>``
(``{"ok": ...}`` or ``{"error": "Type: message"}``); every other stdout line is a log.
It answers ``{"ok": "ready"}`` once started; ``{"op": "quit"}`` (or stdin closing) makes
it close its endpoint and exit.

- trainer ``--hub ADDR --token-file PATH --dir MODEL_DIR --version V [--node N]``: its own
  endpoint (tcp engine, on node N, default ``trainer-node``) publishes the HF state dict on
  disk as ``policy@V`` and holds it; with ``--bad-version W`` also ``policy@W``, B negated
  with one tensor cut short (it fetches and verifies, then fails to load).
- engine ``--dir MODEL_DIR``: ``LLM(..., weight_transfer_config={"backend": "tensorhub"})``
  in this process (no engine-core child: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), float32,
  eager. Ops: ``generate`` (greedy token ids of ``prompt``), ``init`` (``init_info``),
  ``update`` (``update_info``: start, update, finish; answers the engine's ``metrics``
  and ``wall_s``, start to finish end, measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

PREFIX = "@th "


def make_model(path, seed: int) -> None:
    """A random tiny Llama (hidden 256, 2 layers, 4 query heads over 2 KV heads: vLLM
    fuses q/k/v and gate/up on load) with a word-level tokenizer: the bench's model."""
    from tensorhub_cli.bench.vllm_rl import config
    from tensorhub_cli.bench.vllm_rl import make_model as make

    make(path, config(hidden=256, layers=2), seed)


def answer(**reply) -> None:
    sys.stdout.write(PREFIX + json.dumps(reply) + "\n")
    sys.stdout.flush()


def serve(handle) -> None:
    """Answer stdin commands with ``handle(cmd)`` until quit or EOF."""
    answer(ok="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            return
        try:
            answer(ok=handle(cmd))
        except Exception as exc:
            traceback.print_exc(file=sys.stdout)
            answer(error=f"{type(exc).__name__}: {exc}")


def _unknown(role: str, cmd: dict):
    raise ValueError(f"{role}: unknown op {cmd.get('op')!r}")


def trainer(args) -> None:
    from safetensors.torch import load_file

    from tensorhub_cli.api import connect

    state = load_file(os.path.join(args.dir, "model.safetensors"))
    token = open(args.token_file).read().strip()
    with connect(hub=args.hub, token=token, name=args.name, node=args.node, engine="tcp", heartbeat_s=0.2) as ep:
        ep.publish("policy", args.version, state)
        if args.bad_version is not None:
            # A version vLLM cannot load: B negated (so a half-done load shows), one tensor
            # of the last layer cut short.
            bad = {k: -v for k, v in state.items()}
            name = "model.layers.1.mlp.down_proj.weight"
            bad[name] = bad[name][: bad[name].shape[0] // 2].clone()
            ep.publish("policy", args.bad_version, bad)
        serve(lambda cmd: _unknown("trainer", cmd))


def engine(args) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
              weight_transfer_config={"backend": "tensorhub"})

    def metrics(worker):
        return dict(worker.weight_transfer_engine.metrics)

    def handle(cmd):
        op = cmd.get("op")
        if op == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"])
            out = llm.generate([cmd["prompt"]], params, use_tqdm=False)
            return list(out[0].outputs[0].token_ids)
        if op == "init":
            llm.init_weight_transfer_engine({"init_info": cmd["init_info"]})
            return None
        if op == "update":
            started = time.monotonic()
            llm.start_weight_update()
            llm.update_weights({"update_info": cmd["update_info"]})
            llm.finish_weight_update(weight_version=str(cmd["update_info"]["version"]))
            wall = time.monotonic() - started
            return {"metrics": llm.collective_rpc(metrics)[0], "wall_s": wall}
        return _unknown("engine", cmd)

    try:
        serve(handle)
    finally:
        llm.collective_rpc("shutdown_weight_transfer_engine")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "engine"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--hub")
    parser.add_argument("--token-file")
    parser.add_argument("--version", type=int)
    parser.add_argument("--name", default="trainer")
    parser.add_argument("--node", default="trainer-node")
    parser.add_argument("--bad-version", type=int)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    (trainer if args.role == "trainer" else engine)(args)


if __name__ == "__main__":  # vLLM spawns: a child re-imports this module
    main()
