"""A trainer and two vLLM engines sharing weight versions through TensorHub.

Protocol. The trainer (a ``transformers`` model loaded from ``MODEL_DIR``, "trained" here
by a small perturbation) publishes its HF state dict as the next version of ``policy``
with its own endpoint: one above the newest the hub holds (``next_version``; 1 on a
fresh cluster), so the example runs any number of times on one cluster (an older number
would be refused ``stale``, one the hub holds ``conflict``: other bytes). Two vLLM
engines started from ``MODEL_DIR`` with the ``"tensorhub"`` weight-transfer backend
each load that version between generations: each worker reads only its shard into a
shadow of its parameters (from ``start_weight_update`` on, while generation could go
on), the first engine from the trainer, the second from the first engine's shadow
(every reader becomes a holder). Public
APIs only: ``tensorhub_cli.api.connect``, ``Endpoint.versions``, ``Endpoint.publish``,
and vLLM's ``LLM`` weight-transfer calls.

Run (a cluster from ``th up specs/local.yaml``, or any hub and its token file):

    python examples/vllm_two_engines.py MODEL_DIR --cluster demo --node node1
    python examples/vllm_two_engines.py MODEL_DIR --hub tcp://127.0.0.1:7700 --token-file TOKEN

On a CPU build of vLLM use a float32 model (``--dtype float32``) and set
``VLLM_CPU_KVCACHE_SPACE=1``.
"""

from __future__ import annotations

import argparse

PROMPT = "The capital of France is"


def next_version(ep, model: str) -> int:
    """One above the newest version of ``model`` the hub holds (retention copies of
    earlier runs included); 1 when it holds none."""
    from tensorhub_cli import HubError

    try:
        held = ep.versions(model)
    except HubError as exc:
        if exc.code != "not_found":  # (not_found: the hub knows no version of it)
            raise
        held = []
    return max((v.version for v in held), default=0) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a Hugging Face checkpoint directory")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--cluster", help="a cluster `th up` started on this machine")
    where.add_argument("--hub", help="the hub's address, tcp://HOST:PORT (with --token-file)")
    parser.add_argument("--token-file", help="the cluster token, with --hub")
    parser.add_argument("--node", help="the node this runs on, with --cluster")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for each engine's update")
    args = parser.parse_args()
    if args.hub and not args.token_file:
        parser.error("--hub needs --token-file")

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from tensorhub_cli.api import connect

    if args.cluster:
        where = {"cluster": args.cluster, **({"node": args.node} if args.node else {})}
        trainer_ep = connect(cluster=args.cluster, node=args.node, name="example-trainer")
    else:
        where = {"hub": args.hub, "token_file": args.token_file}
        token = open(args.token_file).read().strip()
        trainer_ep = connect(hub=args.hub, token=token, name="example-trainer")

    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    engines = [LLM(model=args.model_dir, dtype=args.dtype, enforce_eager=True, max_model_len=256,
                   weight_transfer_config={"backend": "tensorhub"}) for _ in range(2)]
    for i, llm in enumerate(engines):
        llm.init_weight_transfer_engine({"init_info": {**where, "model": "policy", "name": f"example-engine{i}"}})
        print(f"engine {i}, weights on disk:", llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text)

    with trainer_ep:
        trainer = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
        with torch.no_grad():  # stands in for a training step
            for p in trainer.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        # HF names: each engine's worker maps them onto its own (fused, sliced) parameters.
        version = next_version(trainer_ep, "policy")
        trainer_ep.publish("policy", version, {n: p.detach() for n, p in trainer.named_parameters()})

        for i, llm in enumerate(engines):
            llm.start_weight_update()  # (generation is paused by the caller meanwhile)
            llm.update_weights({"update_info": {"version": version, "timeout": args.timeout}})
            llm.finish_weight_update(weight_version=str(version))
            print(f"engine {i}, version {version}:",
                  llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].text)

        for llm in engines:  # unpublish the engines' shadows while the hub is reachable
            llm.shutdown_weight_transfer_engine()


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this file
    main()
