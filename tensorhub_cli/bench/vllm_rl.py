"""`th bench rl --workload vllm`: a real vLLM engine's weight update per version, ours
against reloading the same version from disk, in one run.

Processes (each stopped by its PID): a hub, a trainer (its own endpoint) and one vLLM
engine (``LLM(..., weight_transfer_config={"backend": "tensorhub"})``, CPU, float32,
eager, in-process engine core). Per version v, interleaved so drift hits both arms:

- the trainer makes v's weights (a seed per version), publishes them (``publish_s``)
  and saves them as safetensors in a directory of their own (``save_s``: the
  checkpoint a disk-reloading stack writes every step);
- ours: ``start_weight_update`` → ``update_weights({"version": v})`` →
  ``finish_weight_update`` (``update_s``, the engine's pause to resume, with the
  adapter's per-stage split: resolve, setup, plan wait, transfer, verify, load);
- baseline: ``reload_weights(weights_path=DIR_v)`` on the same engine (``reload_s``);
- both arms then generate greedily from one prompt: the token ids must be equal (the
  same version, by two routes), else the run fails.

The ratio is per version: (save + reload) / (publish + update), medians over versions
(the first one also pays first-use costs on both sides and is reported, not dropped).
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


def run(versions: int = 3, hidden: int = 512, layers: int = 4, engine: str = "tcp", timeout_s: float = 600) -> dict:
    if versions < 1:
        raise ValueError(f"versions: want at least 1, got {versions}")
    cfg = config(hidden, layers)
    with tempfile.TemporaryDirectory(prefix="th-bench-vllm-") as tmp, hub() as (address, token):
        base = Path(tmp) / "v0"
        make_model(base, cfg, seed=0)
        token_file = Path(tmp) / "token"
        token_file.write_text(token)
        common = ["--hub", address, "--token-file", str(token_file), "--engine", engine]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        trainer = Driven("trainer", ["-m", "tensorhub_cli.bench.vllm_rl", "trainer", "--dir", str(base), *common])
        llm = Driven("vllm", ["-m", "tensorhub_cli.bench.vllm_rl", "engine", "--dir", str(base), *common], env=env)
        try:
            trainer.hello  # noqa: B018 (started in parallel with the engine)
            llm.ask("init", timeout=timeout_s)
            rows = []
            for v in range(1, versions + 1):
                made = trainer.ask("make", version=v, seed=v, dir=str(Path(tmp) / f"v{v}"), timeout=timeout_s)
                ours = llm.ask("update", version=v, timeout=timeout_s)
                ours_tokens = llm.ask("generate", timeout=timeout_s)["tokens"]
                base_ = llm.ask("reload", dir=made["dir"], timeout=timeout_s)
                base_tokens = llm.ask("generate", timeout=timeout_s)["tokens"]
                if ours_tokens != base_tokens:
                    raise RuntimeError(f"version {v}: the engine generated {ours_tokens} after our update but "
                                       f"{base_tokens} after reloading the same version from disk")
                rows.append({"version": v, "publish_s": made["publish_s"], "save_s": made["save_s"],
                             "update_s": ours["wall_s"], "stages": ours["metrics"], "reload_s": base_["wall_s"],
                             "ratio": (made["save_s"] + base_["wall_s"]) / (made["publish_s"] + ours["wall_s"]),
                             "tokens": ours_tokens})
        finally:
            llm.stop()
            trainer.stop()
    nbytes = rows[0]["stages"].get("bytes", 0)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"workload": "vllm", "engine": engine, "versions": versions, "model": {**cfg, "dtype": "float32"},
            "bytes": nbytes, "rows": rows,
            "ours_s": med("publish_s") + med("update_s"), "baseline_s": med("save_s") + med("reload_s"),
            "update_s": med("update_s"), "reload_s": med("reload_s"), "ratio": med("ratio")}


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

    llm = LLM(model=args.dir, dtype="float32", enforce_eager=True, max_model_len=128, seed=0,
              weight_transfer_config={"backend": "tensorhub"})
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    def metrics(worker):
        return dict(worker.weight_transfer_engine.metrics)

    def handle(op: str, cmd: dict) -> dict:
        if op == "init":
            llm.init_weight_transfer_engine({"init_info": {"hub": args.hub, "token_file": args.token_file,
                                                           "model": "policy", "engine": args.engine}})
            return {}
        if op == "update":
            started = time.monotonic()
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": cmd["version"]}})
            llm.finish_weight_update(weight_version=str(cmd["version"]))
            return {"wall_s": time.monotonic() - started, "metrics": llm.collective_rpc(metrics)[0]}
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
    args = parser.parse_args()
    out = _protocol()
    (trainer if args.role == "trainer" else engine)(args, out)


if __name__ == "__main__":  # vLLM spawns: a child re-imports this module
    main()
