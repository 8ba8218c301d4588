"""Processes for ``test_adapter_vllm``: a tiny Llama on disk, a trainer, a real vLLM engine.

Protocol. ``make_model(dir, seed)`` (in the caller's process) writes a random tiny Llama
(config, safetensors, a ``tokenizers`` tokenizer) that vLLM's CPU build runs.
``python -m tests.integration.vllm_driver trainer|engine ARGS`` is a child that reads one
JSON command per stdin line and answers each with one stdout line ``@th <json>``
(``{"ok": ...}`` or ``{"error": "Type: message"}``); every other stdout line is a log.
It answers ``{"ok": "ready"}`` once started; ``{"op": "quit"}`` (or stdin closing) makes
it close its endpoint and exit.

- trainer ``--hub ADDR --token-file PATH --dir MODEL_DIR [--version V] [--node N]``: its own
  endpoint (tcp engine, on node N, default ``trainer-node``) publishes the HF state dict on
  disk as ``policy@V`` and holds it; with ``--bad-version W`` also ``policy@W``, B negated
  with one tensor cut short (it fetches and verifies, then fails to load). Op ``publish``
  (``version``, ``dir``): a copy of the state dict in ``dir`` as ``policy@version``.
- engine ``--dir MODEL_DIR [--tp N]``: ``LLM(..., weight_transfer_config={"backend":
  "tensorhub"})`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
  with ``--tp`` 2 or more, vLLM's multiproc executor starts one worker process per TP rank,
  each pinned to one core), float32, eager. Ops: ``generate`` (greedy token ids of
  ``prompt``), ``init`` (``init_info``), ``update`` (``update_info``: start, update,
  finish; answers rank 0's ``metrics``, ``wall_s`` (start to finish end, measured here)
  and ``ranks``: per TP rank its ``version`` loaded, endpoint ``group`` and the
  ``digest`` of the staging copy it loaded from), ``gate`` (``dir``: from now on each
  rank's fetch waits for the file ``DIR/rank<R>-<N>`` (its N-th fetch, from 1) and
  touches ``DIR/rank<R>-<N>.done`` once it returned, so a test orders the ranks' fetches
  and acts between them).

``digest(state)`` names a {name: tensor} dict's bytes (sha256 over names and raw bytes).
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


def digest(state: dict) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
        if args.version is not None:
            ep.publish("policy", args.version, state)
        if args.bad_version is not None:
            # A version vLLM cannot load: B negated (so a half-done load shows), one tensor
            # of the last layer cut short.
            bad = {k: -v for k, v in state.items()}
            name = "model.layers.1.mlp.down_proj.weight"
            bad[name] = bad[name][: bad[name].shape[0] // 2].clone()
            ep.publish("policy", args.bad_version, bad)

        def handle(cmd):
            if cmd.get("op") == "publish":  # (a copy each: a version's memory is its own)
                ep.publish("policy", cmd["version"], load_file(os.path.join(cmd["dir"], "model.safetensors")))
                return cmd["version"]
            return _unknown("trainer", cmd)

        serve(handle)


def engine(args) -> None:
    from vllm import LLM, SamplingParams

    parallel = {}
    if args.tp > 1:
        # vLLM's CPU workers bind OpenMP threads per NUMA node by default and refuse more
        # ranks than nodes: one core each instead.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)))
        parallel = dict(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    llm = LLM(model=args.dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
              weight_transfer_config={"backend": "tensorhub"}, **parallel)

    def metrics(worker):
        return dict(worker.weight_transfer_engine.metrics)

    def rank_state(worker):
        engine = worker.weight_transfer_engine
        staging = engine._staging.get(engine.loaded)
        return {"version": engine.loaded, "group": engine.endpoint.info.group,
                "digest": digest(staging) if staging is not None else None}

    def install_gate(worker, where):
        # Runs in each rank's process: its endpoint's fetch waits for its gate file.
        import pathlib

        engine = worker.weight_transfer_engine
        rank, real, count = worker.vllm_config.parallel_config.rank, engine.endpoint.fetch, [0]

        def gated(*a, **kw):
            count[0] += 1
            gate = pathlib.Path(where) / f"rank{rank}-{count[0]}"
            deadline = time.monotonic() + 120
            while not gate.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: gate {gate} not opened within 120s")
                time.sleep(0.02)
            try:
                return real(*a, **kw)
            finally:
                pathlib.Path(f"{gate}.done").touch()

        engine.endpoint.fetch = gated
        return rank

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
            return {"metrics": llm.collective_rpc(metrics)[0], "wall_s": wall, "ranks": llm.collective_rpc(rank_state)}
        if op == "gate":
            return llm.collective_rpc(install_gate, args=(cmd["dir"],))
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
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    (trainer if args.role == "trainer" else engine)(args)


if __name__ == "__main__":  # vLLM spawns: a child re-imports this module
    main()
