"""Processes for ``test_adapter_vllm``: a tiny Llama on disk, a trainer, a real vLLM engine.

Protocol. ``make_model(dir, seed, arch)`` (in the caller's process) writes a random tiny
model (config, safetensors, a ``tokenizers`` tokenizer) that vLLM's CPU build runs.
``python -m tests.integration.vllm_driver trainer|engine ARGS`` is a child that reads one
JSON command per stdin line and answers each with one stdout line ``@th <json>``
(``{"ok": ...}`` or ``{"error": "Type: message"}``); every other stdout line is a log.
It answers ``{"ok": "ready"}`` once started; ``{"op": "quit"}`` (or stdin closing) makes
it close its endpoint and exit.

- trainer ``--hub ADDR --token-file PATH --dir MODEL_DIR [--version V] [--node N]
  [--small-bytes B] [--chunk-bytes B]``: its own
  endpoint (tcp engine, on node N, default ``trainer-node``) publishes the HF state dict on
  disk as ``policy@V`` and holds it; with ``--bad-version W`` also ``policy@W``, B negated
  with one tensor cut short (refused before a byte moves). Op ``publish`` (``version``,
  ``dir``, optional ``model``): a copy of the state dict in ``dir`` as
  ``MODEL@version`` (default ``policy``).
- engine ``--dir MODEL_DIR [--tp N]``: ``LLM(..., weight_transfer_config={"backend":
  "tensorhub"})`` with its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``;
  with ``--tp`` 2 or more, vLLM's multiproc executor starts one worker process per TP rank,
  each pinned to one core), float32, eager. Ops: ``generate`` (greedy token ids of
  ``prompt``), ``init`` (``init_info``), ``update`` (``update_info``: start, update,
  finish; with ``generate`` (a prompt) the engine generates between start and the
  update, and the ranks' reads are waited for before it; answers each rank's
  ``metrics``, ``wall_s`` (start to finish end), ``pause_wall_s`` (update to finish
  end, measured here), ``during`` (the tokens generated meanwhile) and ``ranks``: per
  TP rank its ``version`` loaded, endpoint ``group``, ``path`` and, given ``dir``,
  ``problems``: how what it holds differs from that checkpoint's slices), ``info``
  (per rank the parameter classes and their apply mode, or why the whole path),
  ``reload`` (vLLM's own ``reload_weights`` from ``dir``), ``gate`` (``dir``: from now
  on each rank's fetch waits for the file ``DIR/rank<R>-<N>`` (its N-th fetch, from 1)
  and touches ``DIR/rank<R>-<N>.done`` once it returned, so a test orders the ranks'
  fetches and acts between them).
- exit ``--dir MODEL_DIR [--init JSON]``: an engine (with the backend when ``--init``
  is given) takes version 1, prints ``@th done`` and returns from main without shutting
  anything down (``test_adapter_vllm_exit``).

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


def make_model(path, seed: int, arch: str = "llama") -> None:
    """A random tiny model of ``arch`` with a word-level tokenizer. ``llama`` (the
    bench's: hidden 256, 2 layers, 4 query heads over 2 KV heads: vLLM fuses q/k/v and
    gate/up on load), ``qwen2`` (q/k/v biases), ``qwen3`` (q/k norms, tied
    embeddings: vLLM's lm_head is the embedding), ``qwen3_moe`` (4 experts, vLLM's
    fused w13/w2 expert tensors) and ``gpt2`` (Conv1D weights its vLLM loader
    transposes: not mappable, the whole-tensor path)."""
    from tensorhub_cli.bench.vllm_rl import WORDS, config
    from tensorhub_cli.bench.vllm_rl import make_model as make

    if arch == "llama":
        return make(path, config(hidden=256, layers=2), seed)
    import torch
    import transformers as tf

    # (its own directory: with the model's config beside it, transformers would pick the
    # architecture's tokenizer class over the word-level one)
    make_tokenizer(os.path.join(path, "tokenizer"))
    vocab = len(WORDS) + 3
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    made = {
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)),
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=2, n_head=4,
                                                         n_positions=256, bos_token_id=1, eos_token_id=2,
                                                         initializer_range=0.2)),
    }
    if arch not in made:
        raise ValueError(f"arch: one of llama, {', '.join(made)}; not {arch!r}")
    torch.manual_seed(seed)
    model = made[arch]()
    with torch.no_grad():  # (norms start at 1 and biases at 0: random, so a wrong map shows)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.to(torch.float32).save_pretrained(path)


def make_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tensorhub_cli.bench.vllm_rl import WORDS

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def tokenizer_of(directory) -> str:
    """Where ``make_model`` put the tokenizer of the model in ``directory``."""
    own = os.path.join(directory, "tokenizer")
    return own if os.path.isdir(own) else str(directory)


def check_slices(held: list, directory: str) -> list[str]:
    """Every way what a worker holds (``held_slices``) differs from the checkpoint in
    ``directory``: each slot must be the box of its HF tensor, bit for bit."""
    from safetensors.torch import load_file

    want = load_file(os.path.join(directory, "model.safetensors"))
    problems = []
    for name, box, t in held:
        if name not in want:
            problems.append(f"{name}: not in {directory}")
            continue
        ref = want[name]
        if box is not None:
            ref = ref[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
        if tuple(ref.shape) != tuple(t.shape) or not torch_equal(ref, t):
            problems.append(f"{name} {box}: differs")
    return problems


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a.contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


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
    # --small-bytes: the size below which the publisher packs tensors into shared chunks
    # (read whole): a tiny model's are all below the default 1 MiB, a real model's few.
    options = {"small_bytes": args.small_bytes} if args.small_bytes else {}
    if args.chunk_bytes:  # (likewise: a tiny tensor is one chunk, one row block of tiles)
        options["chunk_bytes"] = args.chunk_bytes
    with connect(hub=args.hub, token=token, name=args.name, node=args.node, engine="tcp", heartbeat_s=0.2,
                 **options) as ep:
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
                ep.publish(cmd.get("model", "policy"), cmd["version"],
                           load_file(os.path.join(cmd["dir"], "model.safetensors")))
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
    llm = LLM(model=args.dir, tokenizer=tokenizer_of(args.dir), dtype="float32", enforce_eager=True,
              max_model_len=128, seed=0, weight_transfer_config={"backend": "tensorhub"}, **parallel)

    def metrics(worker):
        return dict(worker.weight_transfer_engine.metrics)

    def rank_state(worker, directory=None):
        engine = worker.weight_transfer_engine
        held = engine.held_slices()
        return {"version": engine.loaded, "group": engine.endpoint.info.group, "path": engine.metrics.get("path"),
                "held": len(held), "problems": check_slices(held, directory) if directory else None}

    def info(worker):
        engine = worker.weight_transfer_engine
        shard = engine.shadows.emap.shard_bytes if engine.shadows is not None else None
        import prometheus_client

        exposed = sorted({m.name for m in prometheus_client.REGISTRY.collect() if m.name.startswith("th_")})
        return {"classes": engine.classes, "reason": engine.path_reason, "shard_bytes": shard, "metrics": exposed}

    def sglang_probe(worker):
        # layout.sglang_map's recording and probe over this worker's real vLLM model
        # objects (SGLang's layers keep vLLM's loader contract), put in their loader
        # form first, as SGLang's begin_weight_update does for its own: vLLM's raw
        # parameters (its reload metadata), each with its own loader (vLLM's reload
        # wrapper taken off). Per parameter: the same boxes and regions as vllm_map's?
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _get_original_loader
        from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

        from tensorhub_cli.layout.engine_map import Unmapped
        from tensorhub_cli.layout.sglang_map import derive
        from tensorhub_cli.layout.vllm_map import restore, snapshot

        engine = worker.weight_transfer_engine
        ours, saved, loaders = engine.shadows.emap, [], []
        try:
            for _, layer in engine.model.named_modules():
                info = LAYERWISE_INFO.get(layer)
                if info is None or not any(p is not None for p in layer._parameters.values()):
                    continue
                saved.append((layer, snapshot(layer)))
                restore_layer_on_meta(layer, info)
                for param in layer._parameters.values():
                    if param is not None and "weight_loader" in param.__dict__:
                        loaders.append((param, param.__dict__["weight_loader"]))
                        param.__dict__["weight_loader"] = _get_original_loader(param)
            theirs = derive(engine.model, dict(ours.tensors))
        except Unmapped as exc:
            return {"unmapped": str(exc)}
        finally:
            for param, loader in loaders:
                param.__dict__["weight_loader"] = loader
            for layer, snap in saved:
                restore(layer, snap)
        same, differ = 0, []
        for path, lp in ours.layers.items():
            for name, pp in lp.params.items():
                other = theirs.layers[path].params.get(name) if path in theirs.layers else None
                if other is None:
                    differ.append(f"{path}.{name}: not mapped")
                elif other.shape == pp.shape and sorted(map(repr, other.slots)) == sorted(map(repr, pp.slots)):
                    same += 1
                else:
                    differ.append(f"{path}.{name}: {other.shape} {other.slots} vs {pp.shape} {pp.slots}")
        return {"same": same, "differ": differ, "shard_bytes": [ours.shard_bytes, theirs.shard_bytes]}

    def prefetched(worker):
        engine = worker.weight_transfer_engine
        return engine.shadows is None or engine.shadows.prefetched()

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
            # With "generate": start, then generate while the workers read the version,
            # then wait for their reads; the pause (update + finish) is timed apart.
            started = time.monotonic()
            llm.start_weight_update()
            during = None
            if cmd.get("generate"):
                during = list(llm.generate([cmd["generate"]], SamplingParams(temperature=0.0, max_tokens=8),
                                           use_tqdm=False)[0].outputs[0].token_ids)
                deadline = time.monotonic() + 60
                while not all(llm.collective_rpc(prefetched)) and time.monotonic() < deadline:
                    time.sleep(0.02)
            paused = time.monotonic()
            llm.update_weights({"update_info": cmd["update_info"]})
            llm.finish_weight_update(weight_version=str(cmd["update_info"]["version"]))
            ended = time.monotonic()
            return {"metrics": llm.collective_rpc(metrics), "wall_s": ended - started, "pause_wall_s": ended - paused,
                    "during": during, "ranks": llm.collective_rpc(rank_state, args=(cmd.get("dir"),))}
        if op == "info":
            return llm.collective_rpc(info)
        if op == "sglang_probe":
            return llm.collective_rpc(sglang_probe)
        if op == "reload":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": cmd["dir"]})
            return None
        if op == "gate":
            return llm.collective_rpc(install_gate, args=(cmd["dir"],))
        return _unknown("engine", cmd)

    try:
        serve(handle)
    finally:
        llm.collective_rpc("shutdown_weight_transfer_engine")


def exit_(args) -> None:
    """Start an engine (with the backend when ``--init`` names one), take version 1,
    print ``@th done`` and return from main without shutting anything down: what a
    user's script does when it ends."""
    from vllm import LLM, SamplingParams

    options = {"weight_transfer_config": {"backend": "tensorhub"}} if args.init else {}
    llm = LLM(model=args.dir, tokenizer=tokenizer_of(args.dir), dtype="float32", enforce_eager=True,
              max_model_len=128, seed=0, **options)
    llm.generate(["w1 w2"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    if args.init:
        llm.init_weight_transfer_engine({"init_info": json.loads(args.init)})
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": 1}})
        llm.finish_weight_update(weight_version="1")
    sys.stdout.write(PREFIX + "done\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["trainer", "engine", "exit"])
    parser.add_argument("--init", help="exit: the init_info (JSON) of the backend")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--hub")
    parser.add_argument("--token-file")
    parser.add_argument("--version", type=int)
    parser.add_argument("--name", default="trainer")
    parser.add_argument("--node", default="trainer-node")
    parser.add_argument("--bad-version", type=int)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--small-bytes", type=int)
    parser.add_argument("--chunk-bytes", type=int)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    {"trainer": trainer, "engine": engine, "exit": exit_}[args.role](args)


if __name__ == "__main__":  # vLLM spawns: a child re-imports this module
    main()
