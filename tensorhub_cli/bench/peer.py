"""A benchmark endpoint process: ``python -m tensorhub_cli.bench.peer --hub A --token T --name N``.

It answers one JSON line per JSON line on stdin (see ``rig.Driven``). Besides the
endpoint's own publish/fetch it can serve and read the same memory with raw NIXL (one
READ of every chunk, no hub, no checksums) and a raw TCP socket (one stream), so that
a benchmark compares our path with the bare transports between the same two processes.
For ``p2p --layout tp2`` it publishes its rank's rows of a Llama (``publish_rows``), or
prepares a TP rank's two destinations (``prepare_tp``) and fetches into one of them,
checked bit for bit (``fetch_tp``).
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
import threading
import time
import traceback

import torch

from tensorhub_cli import connect
from tensorhub_cli.engines.base import host_view


def tensors(mib: float, seed: int) -> dict[str, torch.Tensor]:
    n = int(mib * 2**20) // 4 // 4
    return {f"w{i}": torch.arange(n, dtype=torch.int32) * (seed + i) for i in range(4)}


class Peer:
    def __init__(self, ep):
        self.ep = ep
        self.mine: dict = {}  # (model, version) -> published tensors
        self.dst: dict | None = None
        self.raw = None
        self.raw_registered = False
        self.tp_layouts: dict = {}  # p2p --layout tp2: this TP rank, and what each layout must hold

    def publish(self, model: str, version: int, mib: float, chunk_mib: float = 16) -> dict:
        sd = self.mine[(model, version)] = tensors(mib, version)
        m = self.ep.publish(model, version, sd, chunk_bytes=int(chunk_mib * 2**20))
        return {"chunks": len(m.chunks)}

    def prepare(self, mib: float) -> dict:
        self.dst = {k: torch.zeros_like(v) for k, v in tensors(mib, 0).items()}  # zeros_like touches every page
        return {"prepared": sum(t.nbytes for t in self.dst.values())}

    def fetch(self, model: str, version: int, window: int = 4, timeout: float = 300, check: bool = True) -> dict:
        """``check=False``: leave the bytes' check to ``check`` (a fan-out counts the
        endpoints' CPU until every reader is done; rebuilding the payload to compare it is
        the bench's work, not the endpoint's)."""
        t0 = time.monotonic()
        got = self.ep.fetch(model, version, into=self.dst, window=window, timeout=timeout)
        t1 = time.monotonic()
        out = {"version": got, "s": t1 - t0, "t_done": t1, "stats": self.ep.last_fetch}
        return {**out, **self.check(version)} if check else out

    def check(self, version: int) -> dict:
        """Whether the destination holds ``version``'s payload, bit for bit."""
        mib = sum(t.nbytes for t in self.dst.values()) / 2**20
        return {"equal": all(torch.equal(self.dst[k], v) for k, v in tensors(mib, version).items())}

    def unpublish(self, model: str, version: int) -> dict:
        self.ep.unpublish(model, version)
        self.mine.pop((model, version), None)
        return {"unpublished": version}

    # --- p2p --layout tp2 (``p2p.run_tp2``) ----------------------------------------------

    def publish_rows(self, model: str, version: int, config: dict, seed: int, rank: int, world: int,
                     chunk_mib: float = 16) -> dict:
        """Publish rows ``split(out, world, rank)`` of every HF tensor as ``Part``s."""
        from tensorhub_cli.bench.p2p import llama_weights
        from tensorhub_cli.layout.boxes import split
        from tensorhub_cli.layout.targets import Part

        parts = {}
        for name, t in llama_weights(config, seed).items():
            start, size = split(t.shape[0], world, rank)
            parts[name] = Part(t.narrow(0, start, size).clone(), tuple(t.shape), (start,) + (0,) * (t.dim() - 1))
        self.mine[(model, version)] = parts
        m = self.ep.publish(model, version, parts, shard=(rank, world), chunk_bytes=int(chunk_mib * 2**20))
        return {"chunks": len(m.chunks), "bytes": sum(p.tensor.nbytes for p in parts.values())}

    def prepare_tp(self, config: dict, seed: int, rank: int, world: int) -> dict:
        """What TP rank ``rank``'s destinations must hold: ``tp2`` (vLLM's parameters,
        ``vllm_llama.reference``) and ``same`` (its Shard(0) rows of every HF tensor, by
        ``torch.chunk``: an oracle that does not share ``boxes.split``)."""
        import types

        from tensorhub_cli.bench.p2p import llama_weights
        from tensorhub_cli.layout import vllm_llama

        cfg = types.SimpleNamespace(**config)
        full = llama_weights(config, seed)
        self.tp_layouts = {"config": cfg, "rank": rank, "world": world, "shapes": vllm_llama.global_shapes(cfg),
                           "tp2": vllm_llama.reference(full, cfg, rank, world),
                           "same": {n: t.chunk(world, 0)[rank] for n, t in full.items()}}
        return {layout: sum(t.nbytes for t in self.tp_layouts[layout].values()) for layout in ("tp2", "same")}

    def _tp_destination(self, layout: str) -> tuple[dict, dict]:
        """``layout``'s destination: (fetch's ``into``, name -> tensor), made once and
        reused by every fetch (as a running rollout's parameters are: its memory stays
        registered), zeroed before each (outside the timed fetch)."""
        from tensorhub_cli.layout import targets, vllm_llama

        made = self.tp_layouts.setdefault("made", {})
        if layout not in made:
            cfg, rank, world = self.tp_layouts["config"], self.tp_layouts["rank"], self.tp_layouts["world"]
            if layout == "tp2":
                dst = vllm_llama.params(cfg, rank, world, torch.bfloat16)
                made[layout] = vllm_llama.targets(dst, cfg, rank, world), dst
            else:
                dst = {n: torch.zeros_like(t) for n, t in self.tp_layouts["same"].items()}
                made[layout] = ({n: targets.tp(n, t, self.tp_layouts["shapes"][n], 0, rank, world)
                                 for n, t in dst.items()}, dst)
        for t in made[layout][1].values():
            t.zero_()
        return made[layout]

    def fetch_tp(self, model: str, version: int, layout: str, window: int = 4, timeout: float = 300) -> dict:
        if layout not in ("tp2", "same"):
            raise ValueError(f"layout: want tp2 or same, got {layout!r}")
        into, dst = self._tp_destination(layout)
        want = self.tp_layouts[layout]
        t0 = time.monotonic()
        got = self.ep.fetch(model, version, into=into, window=window, timeout=timeout)
        s = time.monotonic() - t0
        bad = [n for n in want if not torch.equal(dst[n], want[n])]
        return {"version": got, "s": s, "equal": not bad, "mismatched": bad[:5],
                "share": sum(t.nbytes for t in dst.values()), "stats": self.ep.last_fetch}

    # --- the bare transports, for comparison -----------------------------------------

    def _raw_agent(self):
        if self.raw is None:
            from tensorhub_cli.engines.nixl_shim import load_nixl

            nixl = load_nixl()
            self.raw = nixl.nixl_agent(f"raw-{self.ep.name}", nixl.nixl_agent_config(enable_prog_thread=False,
                                                                                      backends=["UCX"]))
        return self.raw

    def raw_serve(self, model: str, version: int) -> dict:
        agent = self._raw_agent()
        sd = self.mine[(model, version)]
        regions = [(t.data_ptr(), t.nbytes) for t in sd.values()]
        agent.register_memory([(a, n, 0, "") for a, n in regions], mem_type="DRAM")

        def progress() -> None:  # the passive side must progress, as in our endpoint
            while True:
                agent.get_new_notifs()
                time.sleep(0.001)

        threading.Thread(target=progress, daemon=True).start()
        server = socket.create_server((self.ep.host, 0))

        def serve() -> None:
            while True:
                conn, _ = server.accept()
                with conn:
                    for a, n in regions:
                        conn.sendall(host_view(a, n))

        threading.Thread(target=serve, daemon=True).start()
        return {"md": base64.b64encode(agent.get_agent_metadata()).decode(), "regions": regions,
                "tcp": f"{self.ep.host}:{server.getsockname()[1]}"}

    def raw_nixl(self, md: str, regions: list, chunk_mib: float = 16) -> dict:
        agent = self._raw_agent()
        local = [(t.data_ptr(), t.nbytes) for t in self.dst.values()]
        if not self.raw_registered:  # once per destination (outside the timing either way)
            agent.register_memory([(a, n, 0, "") for a, n in local], mem_type="DRAM")
            self.raw_registered = True
        peer = agent.add_remote_agent(base64.b64decode(md))
        step = int(chunk_mib * 2**20)
        pairs = [((ra + o, min(step, rn - o), 0), (la + o, min(step, rn - o), 0))
                 for (ra, rn), (la, _) in zip(regions, local) for o in range(0, rn, step)]
        rdescs = agent.get_xfer_descs([r for r, _ in pairs], mem_type="DRAM")
        ldescs = agent.get_xfer_descs([lo for _, lo in pairs], mem_type="DRAM")
        t0 = time.monotonic()
        handle = agent.initialize_xfer("READ", ldescs, rdescs, peer)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        s = time.monotonic() - t0
        agent.release_xfer_handle(handle)
        return {"s": s, "state": state}

    def raw_tcp(self, address: str) -> dict:
        host, _, port = address.rpartition(":")
        t0 = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            for t in self.dst.values():
                view, got = host_view(t.data_ptr(), t.nbytes), 0
                while got < t.nbytes:
                    got += sock.recv_into(view[got:])
        return {"s": time.monotonic() - t0}


def arguments() -> argparse.ArgumentParser:
    """The flags every driven endpoint process takes (tests' workers add their own)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--hub", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--engine", default="nixl")
    ap.add_argument("--host", default="127.0.0.1", help="the address we bind and send from (our node's)")
    ap.add_argument("--node", default="local")
    ap.add_argument("--rack", default="")
    ap.add_argument("--dc", default="")
    ap.add_argument("--read-timeout-s", type=float, default=None, help="the endpoint's (default: its own)")
    ap.add_argument("--small-bytes", type=int, default=None,
                    help="tensors below this are packed into shared chunks (default: the endpoint's)")
    return ap


def connect_from(args, **extra):
    """``connect`` with the flags of ``arguments``."""
    if args.read_timeout_s is not None:
        extra.setdefault("read_timeout_s", args.read_timeout_s)
    if args.small_bytes is not None:
        extra.setdefault("small_bytes", args.small_bytes)
    return connect(hub=args.hub, token=args.token, name=args.name, engine=args.engine, host=args.host,
                   node=args.node, rack=args.rack, dc=args.dc, **extra)


def main() -> int:
    return serve(Peer, heartbeat_s=0.5)


def serve(make_peer, heartbeat_s: float) -> int:
    """Connect with the command line's flags, then answer one JSON line per JSON line
    on stdin with ``make_peer(ep)``'s method named by ``op``, until ``exit``."""
    args = arguments().parse_args()
    ep = connect_from(args, heartbeat_s=heartbeat_s)
    peer = make_peer(ep)
    print(json.dumps({"ready": True, "engine": ep.engine.kind}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            ep.close(drain_timeout=cmd.get("drain_timeout", 5))
            print(json.dumps({"closed": True}), flush=True)
            break
        try:
            reply = getattr(peer, op)(**cmd)
        except Exception as exc:
            reply = {"error": str(exc), "type": type(exc).__name__, "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
