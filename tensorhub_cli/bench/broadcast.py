"""One rank of the gloo broadcast baseline of `th bench fanout`:
``python -m tensorhub_cli.bench.broadcast --rank R --world W --init tcp://ADDR:PORT --mib M``.

Protocol (driven by ``rig.Driven``: one JSON line answered per JSON line asked). The
process joins a torch.distributed group of ``W`` ranks (backend gloo, CPU tensors,
rendezvous ``--init``; rank 0 is the publisher's node and hosts the store), then greets
``{"ready": true}``. Gloo binds to the interface in ``GLOO_SOCKET_IFNAME`` (the driver
sets ``eth0`` inside a testbed node, ``lo`` on loopback): by default it resolves the
hostname, which in a testbed node's own UTS namespace names no address.

Two ops per row of the benchmark:

- ``join {members, timeout}``: every rank of the world calls it (``new_group`` is
  collective over the whole world); ranks ``0..members-1`` form the row's group and
  warm it up with one untimed broadcast of the whole payload (other bytes than any
  timed one), so the timed one includes no first-use cost. Answers ``{"member": bool}``.
- ``broadcast {seed}`` (members only): rank 0 fills its buffer with the payload of
  ``seed``, the others zero theirs, all outside the timing; then a barrier (an
  all-gather of two numbers), ``t0``, one broadcast of the payload from rank 0 as one
  flat int32 tensor, ``t_done`` when this rank's call returned. It answers those, and
  whether what it holds equals the payload rebuilt from ``seed`` (``equal``) and its
  CRC-32, so the driver compares every rank's bytes with rank 0's.

The payload is ``bench.peer.tensors(mib, seed)`` laid end to end: the bytes the
endpoint arms of the benchmark publish. Every collective call is bounded by
``timeout`` (``engines.dist.Collective``); a failed row leaves the group unusable and
the driver stops every rank. ``exit`` answers and ends the process without tearing the
group down (a group whose other ranks already left may hang an orderly destroy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from tensorhub_cli.bench.peer import tensors
from tensorhub_cli.engines.dist import Collective


def payload(mib: float, seed: int) -> torch.Tensor:
    """The benchmark's payload for ``seed`` as one flat int32 tensor."""
    return torch.cat(list(tensors(mib, seed).values()))


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().data)


class Rank:
    def __init__(self, rank: int, mib: float):
        self.rank, self.mib = rank, mib
        self.buf = torch.zeros_like(payload(mib, 0))  # (zeros touches every page, outside any timing)
        self.pg, self.members, self.timeout = None, 0, 300.0

    def join(self, members: int, timeout: float = 300) -> dict:
        """Form this row's group (every rank calls it); members warm it up."""
        self.timeout = timeout
        self.pg = dist.new_group(list(range(members)), timeout=timedelta(seconds=timeout))
        self.members = members
        if self.rank >= members:
            return {"member": False}
        # The warm-up's bytes differ from any timed ones (seeds are >= 1): stale bytes cannot pass the check.
        self._fill(-members)
        self._collective().broadcast("warm-up broadcast", self.buf, root=0)
        return {"member": True}

    def broadcast(self, seed: int) -> dict:
        """The timed broadcast of the payload of ``seed``, checked."""
        if self.pg is None or self.rank >= self.members:
            raise ValueError("broadcast: this rank is in no group (join first)")
        self._fill(seed)
        coll = self._collective()
        coll.agree("barrier", True)
        t0 = time.monotonic()
        coll.broadcast("broadcast", self.buf, root=0)
        t_done = time.monotonic()
        equal = torch.equal(self.buf, payload(self.mib, seed))
        return {"t0": t0, "t_done": t_done, "equal": equal, "crc32": crc(self.buf), "bytes": self.buf.nbytes}

    def _collective(self) -> Collective:
        return Collective(self.pg, deadline=time.monotonic() + self.timeout, timeout=self.timeout,
                          what=f"the broadcast baseline's group of {self.members} ranks")

    def _fill(self, seed: int) -> None:
        if self.rank == 0:
            self.buf.copy_(payload(self.mib, seed))
        else:
            self.buf.zero_()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorhub_cli.bench.broadcast")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True, help="tcp://ADDR:PORT of rank 0's store")
    ap.add_argument("--mib", type=float, required=True)
    ap.add_argument("--timeout-s", type=float, default=300, help="rendezvous and default collective timeout")
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout_s))
    me = Rank(args.rank, args.mib)
    print(json.dumps({"ready": True, "rank": args.rank}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            print(json.dumps({"closed": True}), flush=True)
            os._exit(0)
        try:
            reply = getattr(me, op)(**cmd)
        except Exception as exc:
            reply = {"error": f"rank {args.rank}: {exc}", "type": type(exc).__name__, "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
