"""One gloo rank with its own endpoint (tcp engine), for ``test_layouts_dist``.

``python -m tests.integration.dist_worker --hub ADDR --token T --name N --rank R --world W --port P``

Protocol. The process joins a torch.distributed group of ``W`` ranks (gloo, rendezvous
at 127.0.0.1:P), connects endpoint ``N`` to the hub, and prints ``@@ {"ready": true}``.
Then each stdin line is one JSON op; each gets exactly one ``@@ `` reply line on stdout
(other stdout lines are library noise and are ignored by the test): the op's result, or
``{"error", "trace"}``. Every rank of a group gets the same ops in the same order,
since building DTensors is collective. ``exit`` closes the endpoint, destroys the
process group and ends the process.

Tensors are made from a seed, so every process (and the test) rebuilds the exact global
bytes; a reader checks its own bytes against a plain ``torch.chunk`` of them (an oracle
that shares nothing with ``layout.boxes``) and answers only what it read, never tensors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tensorhub_cli import connect

# Small chunks so tensors span several chunks and column readers read tiles.
CHUNK_BYTES, SMALL_BYTES = 64 << 10, 8 << 10
FETCH_TIMEOUT_S = 60.0
LLAMA = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, vocab_size=512)


def tensors(kind: str, seed: int) -> dict[str, torch.Tensor]:
    """The global tensors of a case. ``mixed``: several chunks per tensor, four dtypes,
    two small tensors packed together, and ``e`` (128 KiB, 3-D), which a Shard(1)
    reader cuts on a middle dim. ``uneven``: first dims that 2 and 4 ranks do not
    divide, some leaving a rank an empty shard (torch.chunk sizes)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mixed":
        return {"w": torch.randn(256, 256, generator=g), "e": torch.randn(64, 32, 16, generator=g),
                "bf": torch.randn(96, 256, generator=g).bfloat16(), "b": torch.randn(7, generator=g),
                "h": torch.randn(33, 12, generator=g).half(),
                "n": torch.randint(-2**40, 2**40, (64, 64), generator=g)}
    if kind == "fsdp":
        return {k: v.detach().clone() for k, v in fsdp_module(seed).state_dict().items()}
    if kind == "uneven":
        return {"five": torch.randn(5, 96, generator=g), "seven": torch.randn(7, 1024, generator=g),
                "three": torch.randn(3, 4096, generator=g), "tri": torch.randn(3, generator=g),
                "one": torch.randn(1, 300, generator=g)}
    raise ValueError(f"kind: unknown tensor set {kind!r}")


def placements(code: str, t: torch.Tensor) -> list:
    """``s0``/``s1``/``r`` on a 1-D mesh, ``s0,r``/``r,s1`` on a 2-D one; a dim a
    tensor lacks falls back to dim 0 (a 1-D bias is split by rows)."""
    out = []
    for p in code.split(","):
        if p == "r":
            out.append(Replicate())
        else:
            out.append(Shard(min(int(p[1:]), t.dim() - 1)))
    return out


def chunk_of(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    pieces = t.chunk(world, dim)
    return pieces[rank] if rank < len(pieces) else t.narrow(dim, t.shape[dim], 0)


def fsdp_module(seed: int) -> torch.nn.Module:
    """A model as FSDP2 leaves it: parameters (sharded by ``fully_shard``) beside
    buffers it leaves plain, a small one (rotary ``inv_freq``, packed with others) and
    one big enough to be chunked in place (128 KiB: two chunks)."""
    torch.manual_seed(seed)  # the layers' init draws from the global generator
    m = torch.nn.Module()
    m.up, m.down, m.norm = torch.nn.Linear(64, 256), torch.nn.Linear(256, 7), torch.nn.LayerNorm(7)
    m.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    m.register_buffer("cache", torch.randn(128, 256))
    return m


def llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA, torch_dtype=torch.float32)
    torch.manual_seed(seed)  # the weights' init draws from the global generator
    model = LlamaForCausalLM(config).float()
    return config, {k: v.detach().contiguous() for k, v in model.state_dict().items()}


class Worker:
    def __init__(self, args):
        self.rank, self.world = args.rank, args.world
        self.ep = connect(args.hub, args.token, name=args.name, engine="tcp", chunk_bytes=CHUNK_BYTES,
                          small_bytes=SMALL_BYTES, heartbeat_s=0.2)
        self.keep: list = []  # published tensors must outlive the publish (registered in place)
        self.meshes: dict = {}

    def mesh(self, shape):
        # One mesh per shape: a new mesh is a collective new_group on every rank.
        shape = tuple(shape)
        if shape not in self.meshes:
            self.meshes[shape] = init_device_mesh("cpu", shape)
        return self.meshes[shape]

    def publish(self, c: dict) -> dict:
        full = tensors(c["kind"], c["seed"])
        mesh = self.mesh(c["mesh"])
        sd = {n: distribute_tensor(t, mesh, placements(c["placements"], t)) for n, t in full.items()}
        self.keep.append(sd)
        manifest = self.ep.publish(c["model"], 1, sd)
        return {"tensors": [[t.name, t.nbytes, t.shape, t.box_offsets] for t in manifest.tensors]}

    def fsdp_publish(self, c: dict) -> dict:
        """Publish ``fsdp_module``'s state_dict after ``fully_shard`` over this group,
        as an FSDP2 trainer would: DTensors beside plain buffers."""
        from torch.distributed.fsdp import fully_shard

        m = fsdp_module(c["seed"])
        mesh = self.mesh((self.world,))
        for layer in (m.up, m.down):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        sd = m.state_dict()
        kinds = sorted({type(v).__name__ for v in sd.values()})
        if kinds != ["DTensor", "Tensor"]:  # the case needs both, as FSDP2 gives them
            raise AssertionError(f"fully_shard gave a state_dict of {kinds}, not DTensors beside plain buffers")
        self.keep.append(m)
        manifest = self.ep.publish(c["model"], 1, sd)
        return {"tensors": [[t.name, t.nbytes, t.shape, t.box_offsets] for t in manifest.tensors]}

    def fetch(self, c: dict) -> dict:
        """Fill DTensors sharded over this group (1-D mesh, ``Shard(dim)``) and check
        each local shard, and the gathered whole, against the global tensors."""
        full = tensors(c["kind"], c["seed"])
        mesh = self.mesh((self.world,))
        into, dims = {}, {}
        for name, t in full.items():
            pl = placements(c["placements"], t)
            dims[name] = pl[0].dim
            if c["build"] == "distribute":
                into[name] = distribute_tensor(torch.zeros_like(t), mesh, pl)
            else:
                local = torch.zeros_like(chunk_of(t, pl[0].dim, self.rank, self.world)).contiguous()
                into[name] = DTensor.from_local(local, mesh, pl, shape=t.shape, stride=t.stride())
        self.ep.fetch(c["model"], 1, into=into, timeout=FETCH_TIMEOUT_S)
        bad = [n for n, t in full.items()
               if not torch.equal(into[n].to_local(), chunk_of(t, dims[n], self.rank, self.world))]
        if bad:
            raise AssertionError(f"rank {self.rank}: local shards differ from the global tensors' slices: {bad}")
        gathered = [n for n, t in full.items() if not torch.equal(into[n].full_tensor(), t)]
        if gathered:
            raise AssertionError(f"rank {self.rank}: full_tensor() differs from the global tensors: {gathered}")
        share = sum(dt.to_local().nbytes for dt in into.values())
        self.ep.unpublish(c["model"], 1, timeout=30)  # the next case's destination is new memory
        return {**self.ep.last_fetch, "share": share}

    def llama_publish(self, c: dict) -> dict:
        from tensorhub_cli.layout import vllm_llama

        config, full = llama(c["seed"])
        want = vllm_llama.global_shapes(config)
        got = {k: tuple(v.shape) for k, v in full.items()}
        if got != want:  # the layout's HF names must be the model's own
            raise AssertionError(f"state_dict differs from vllm_llama.global_shapes: {set(got) ^ set(want)}")
        mesh = self.mesh((self.world,))
        sd = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
        self.keep.append(sd)
        self.ep.publish(c["model"], 1, sd)
        return {"bytes": sum(t.nbytes for t in full.values())}

    def llama_fetch(self, c: dict) -> dict:
        """This process as vLLM TP rank ``rank`` of ``world``: fetch into its params,
        compare with ``vllm_llama.reference`` bit for bit."""
        from tensorhub_cli.layout import vllm_llama

        config, full = llama(c["seed"])
        params = vllm_llama.params(config, self.rank, self.world, torch.float32)
        self.ep.fetch(c["model"], 1, into=vllm_llama.targets(params, config, self.rank, self.world),
                      timeout=FETCH_TIMEOUT_S)
        ref = vllm_llama.reference(full, config, self.rank, self.world)
        if set(ref) != set(params):
            raise AssertionError(f"rank {self.rank}: params and reference name different tensors: "
                                 f"{set(ref) ^ set(params)}")
        bad = [n for n in ref if ref[n].dtype != params[n].dtype or not torch.equal(ref[n], params[n])]
        if bad:
            raise AssertionError(f"rank {self.rank}: params differ from vllm_llama.reference: {bad}")
        stats = dict(self.ep.last_fetch)
        self.ep.unpublish(c["model"], 1, timeout=30)  # params go with this call
        return {**stats, "share": sum(t.nbytes for t in params.values()),
                "model_bytes": sum(t.nbytes for t in full.values())}


def reply(body: dict) -> None:
    print("@@ " + json.dumps(body), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    for flag in ("--hub", "--token", "--name"):
        ap.add_argument(flag, required=True)
    for flag in ("--rank", "--world", "--port"):
        ap.add_argument(flag, type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 shared cores, many processes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=120))
    try:
        worker = Worker(args)
        try:
            reply({"ready": True})
            for line in sys.stdin:
                cmd = json.loads(line)
                op = cmd.pop("op")
                if op == "exit":
                    reply({"bye": True})
                    break
                try:
                    reply(getattr(worker, op)(cmd))
                except Exception as exc:
                    reply({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
        finally:
            worker.ep.close()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
