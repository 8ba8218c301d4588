"""`th bench rl --workload vllm`: a real vLLM engine's weight update per version, ours
against reloading the same version from disk, in one run.

Processes (each stopped by its PID): a hub, a trainer (its own endpoint) and two vLLM
engines (``LLM(..., weight_transfer_config={"backend": "tensorhub"})``, CPU, float32,
eager; with ``tp`` > 1 one worker process per rank, one core each). Per version v,
interleaved so drift hits both arms:

- the trainer makes v's weights (a seed per version), publishes them (``publish_s``)
  and saves them as safetensors in a directory of their own (``save_s``: the
  checkpoint a disk-reloading stack writes every step);
- ours, on the first engine: ``start_weight_update`` (each worker starts reading its
  shard of v into a shadow), the engine generates meanwhile (``during_s``), the driver
  waits for the reads, then the pause: ``update_weights({"version": v})`` +
  ``finish_weight_update`` (``pause_s``, timed by the driver; the adapter's own
  ``pause_s`` and its stages per worker in ``stages``);
- baseline: ``reload_weights(weights_path=DIR_v)`` on the same engine (``reload_s``);
- both arms then generate greedily from one prompt: the token ids must be equal (the
  same version, by two routes), else the run fails;
- the second engine then takes v the same way: what its workers read from the
  trainer (``from_publishers`` bytes) should be 0 (the first engine's workers hold v).

Per version ``bytes`` (each worker of the first engine) against ``shard_bytes`` (what
its parameters hold of the model). Top level: ``pause_ratio`` (median over versions of
pause_s / reload_s), ``bytes_over_shard`` (the largest worker's bytes / its shard, any
version), ``second_engine_from_trainer_bytes`` (summed over versions and workers),
``stages_over_pause`` (per worker and version, the adapter's stages summed / its pause:
the worst one), ``tp``. The first version also pays first-use costs on both sides and
is reported, not dropped.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .rig import Driven, hub

PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8"
WORDS = [f"w{i}" for i in range(250)]


def config(hidden: int, layers: int) -> dict:
    """A Llama vLLM's CPU build runs (4 query heads over 2 KV heads: vLLM fuses q/k/v
    and gate/up on load)."""
    return dict(vocab_size=len(WORDS) + 3, hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
                bos_token_id=1, eos_token_id=2)


def make_model(path: str | Path, cfg: dict, seed: int) -> None:
    """A random Llama of ``cfg`` with a word-level tokenizer, saved where vLLM loads it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**cfg, torch_dtype="float32")).save_pretrained(path)


def run(versions: int = 3, hidden: int = 512, layers: int = 4, engine: str = "tcp", timeout_s: float = 600,
        tp: int = 1, second: bool = True) -> dict:
    if versions < 1:
        raise ValueError(f"versions: want at least 1, got {versions}")
    if tp not in (1, 2, 4):
        raise ValueError(f"tp: want 1, 2 or 4 (the model has 4 attention heads), got {tp}")
    cfg = config(hidden, layers)
    with tempfile.TemporaryDirectory(prefix="th-bench-vllm-") as tmp, hub() as (address, token):
        base = Path(tmp) / "v0"
        make_model(base, cfg, seed=0)
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        common = ["--hub", address, "--token-file", str(token_file), "--engine", engine, "--tp", str(tp)]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        trainer = Driven("trainer", ["-m", "tensorhub_cli.bench.vllm_rl", "trainer", "--dir", str(base), *common])
        engines = [Driven(f"vllm{i}", ["-m", "tensorhub_cli.bench.vllm_rl", "engine", "--dir", str(base),
                                        "--name", f"bench-e{i}", *common], env=env) for i in range(1 + second)]
        try:
            trainer.hello  # noqa: B018 (started in parallel with the engines)
            for llm in engines:  # (one at a time: their starts compete for the same cores)
                llm.ask("init", timeout=timeout_s)
            rows = []
            for v in range(1, versions + 1):
                made = trainer.ask("make", version=v, seed=v, dir=str(Path(tmp) / f"v{v}"), timeout=timeout_s)
                ours = engines[0].ask("update", version=v, timeout=timeout_s)
                ours_tokens = engines[0].ask("generate", timeout=timeout_s)["tokens"]
                base_ = engines[0].ask("reload", dir=made["dir"], timeout=timeout_s)
                base_tokens = engines[0].ask("generate", timeout=timeout_s)["tokens"]
                if ours_tokens != base_tokens:
                    raise RuntimeError(f"version {v}: the engine generated {ours_tokens} after our update but "
                                       f"{base_tokens} after reloading the same version from disk")
                row = {"version": v, "publish_s": made["publish_s"], "save_s": made["save_s"],
                       "pause_s": ours["pause_s"], "during_s": ours["during_s"], "reload_s": base_["wall_s"],
                       "pause_over_reload": ours["pause_s"] / base_["wall_s"],
                       "bytes": [m.get("bytes", 0) for m in ours["metrics"]],
                       "shard_bytes": [m.get("shard_bytes") for m in ours["metrics"]],
                       "stages": ours["metrics"], "tokens": ours_tokens}
                if second:
                    other = engines[1].ask("update", version=v, timeout=timeout_s)
                    row["second_engine"] = {"pause_s": other["pause_s"],
                                            "bytes": [m.get("bytes", 0) for m in other["metrics"]],
                                            "from_trainer_bytes": [m.get("from_publishers", 0)
                                                                   for m in other["metrics"]]}
                rows.append(row)
        finally:
            for llm in engines:
                llm.stop()
            trainer.stop()
    return summarize(rows, {"workload": "vllm", "engine": engine, "versions": versions, "tp": tp,
                            "model": {**cfg, "dtype": "float32"}})


def summarize(rows: list[dict], head: dict) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    over = [b / s for r in rows for b, s in zip(r["bytes"], r["shard_bytes"]) if s]
    sums = []
    for r in rows:
        for m in r["stages"]:
            if m.get("path") == "shard" and m.get("pause_s"):
                parts = ("take_s", "load_s", "between_s", "finish_s")
                sums.append(sum(m.get(k, 0.0) for k in parts) / m["pause_s"])
    second = [sum(r["second_engine"]["from_trainer_bytes"]) for r in rows if "second_engine" in r]
    return {**head, "rows": rows, "bytes": max(max(r["bytes"]) for r in rows),
            "pause_s": med("pause_s"), "reload_s": med("reload_s"), "pause_ratio": med("pause_over_reload"),
            "bytes_over_shard": max(over) if over else None,
            "second_engine_from_trainer_bytes": sum(second) if second else None,
            "stages_over_pause": max(sums, key=lambda x: abs(x - 1)) if sums else None,
            "fetched_in_pause": sum(bool(m.get("fetch_in_pause")) for r in rows for m in r["stages"])}


# --- the child processes --------------------------------------------------------------


def _protocol():
    """The real stdout for answers; everything else printed to fd 1 (vLLM's logs) goes
    to stderr, so no log line is ever taken for an answer."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def _serve(out, handle) -> None:
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            reply = handle(op, cmd)
        except Exception as exc:
            reply = {"error": str(exc), "type": type(exc).__name__, "trace": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def trainer(args, out) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..api import connect

    conf = LlamaConfig.from_pretrained(args.dir)
    token = Path(args.token_file).read_text().strip()
    # The default chunking, as a user's trainer publishes: its tile grid lets a TP
    # worker read its rows' and columns' tiles of this small model as of a big one.
    with connect(hub=args.hub, token=token, name="trainer", node="trainer-node", engine=args.engine) as ep:
        held: list[int] = []

        def handle(op: str, cmd: dict) -> dict:
            if op != "make":
                raise ValueError(f"trainer: unknown op {op!r}")
            torch.manual_seed(cmd["seed"])
            state = {k: v.contiguous() for k, v in LlamaForCausalLM(conf).state_dict().items()}
            started = time.monotonic()
            ep.publish("policy", cmd["version"], state)
            published = time.monotonic()
            os.makedirs(cmd["dir"], exist_ok=True)
            save_file(state, os.path.join(cmd["dir"], "model.safetensors"))
            saved = time.monotonic()
            held.append(cmd["version"])
            while len(held) > 2:  # (the engine already moved on from these)
                ep.unpublish("policy", held.pop(0))
            return {"publish_s": published - started, "save_s": saved - published, "dir": cmd["dir"]}

        _serve(out, handle)


def engine(args, out) -> None:
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
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def metrics(worker):
        return dict(worker.weight_transfer_engine.metrics)

    def prefetched(worker):
        shadows = worker.weight_transfer_engine.shadows
        return shadows is None or shadows.prefetched()

    def handle(op: str, cmd: dict) -> dict:
        if op == "init":
            llm.init_weight_transfer_engine({"init_info": {"hub": args.hub, "token_file": args.token_file,
                                                           "model": "policy", "engine": args.engine,
                                                           "name": args.name}})
            return {}
        if op == "update":
            started = time.monotonic()
            llm.start_weight_update()  # (each worker starts reading its shard)
            llm.generate([PROMPT], greedy, use_tqdm=False)  # generation goes on meanwhile
            deadline = time.monotonic() + 120
            while not all(llm.collective_rpc(prefetched)) and time.monotonic() < deadline:
                time.sleep(0.01)
            paused = time.monotonic()
            llm.update_weights({"update_info": {"version": cmd["version"]}})
            llm.finish_weight_update(weight_version=str(cmd["version"]))
            ended = time.monotonic()
            return {"pause_s": ended - paused, "during_s": paused - started,
                    "metrics": llm.collective_rpc(metrics)}
        if op == "reload":
            started = time.monotonic()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": cmd["dir"]})
            return {"wall_s": time.monotonic() - started}
        if op == "generate":
            got = llm.generate([PROMPT], greedy, use_tqdm=False)
            return {"tokens": list(got[0].outputs[0].token_ids)}
        raise ValueError(f"engine: unknown op {op!r}")

    try:
        _serve(out, handle)
    finally:
        llm.collective_rpc("shutdown_weight_transfer_engine")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tensorhub_cli.bench.vllm_rl")
    parser.add_argument("role", choices=["trainer", "engine"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--hub", required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--engine", default="tcp")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--name", default="bench-engine")
    args = parser.parse_args()
    out = _protocol()
    (trainer if args.role == "trainer" else engine)(args, out)


if __name__ == "__main__":  # vLLM spawns: a child re-imports this module
    main()
