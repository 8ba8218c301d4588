"""DTensor layouts across real gloo process groups (2 and 4 CPU processes).

Each spawned rank builds DTensors from one global tensor (``distribute_tensor``),
runs ``parts`` and ``target``, and saves what it got; the parent checks that the
published parts form an exact cover of each global tensor (replicas published once)
and hold its slices, and that each rank's target is the box of its local shard."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import time
import traceback

import pytest
import torch

from tensorhub_cli.errors import LayoutError
from tensorhub_cli.layout.boxes import Box, cover_problems
from tensorhub_cli.layout.dtensor import parts
from tests.conftest import free_port

JOIN_S = 60


def full(shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


# name: (mesh shape, global shape, placements as (kind, dim))
CASES = {
    2: {"s0": ((2,), (6, 3), [("S", 0)]), "s1": ((2,), (4, 6), [("S", 1)]),
        "rep": ((2,), (5, 3), [("R", None)]), "uneven": ((2,), (5, 2), [("S", 0)]),
        "vec": ((2,), (7,), [("S", 0)])},
    4: {"s0": ((4,), (8, 3), [("S", 0)]), "s1": ((4,), (2, 8), [("S", 1)]),
        "rep": ((4,), (6, 2), [("R", None)]), "uneven": ((4,), (5, 2), [("S", 0)]),
        "mesh2d": ((2, 2), (6, 3), [("S", 0), ("R", None)]),
        "mesh2d_rs": ((2, 2), (3, 4), [("R", None), ("S", 1)]),
        "mesh2d_rr": ((2, 2), (5, 3), [("R", None), ("R", None)])},
}


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(d) if k == "S" else Replicate() for k, d in spec]


def _same_memory(t, local) -> bool:
    return t.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from tensorhub_cli.endpoint.layouts import targets
    from tensorhub_cli.layout import dtensor
    from tensorhub_cli.layout.targets import Part

    result = {}
    # A peer that died must fail the collectives here, not hang them until the join gives up.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=JOIN_S // 2))
    try:
        meshes = {}
        for name, (mshape, gshape, spec) in CASES[world].items():
            mesh = meshes.setdefault(mshape, init_device_mesh("cpu", mshape))
            dt = distribute_tensor(full(gshape), mesh, _placements(spec))
            plain, given = torch.ones(1), Part(torch.ones(1), (2,), (rank % 2,))
            got, rw = dtensor.parts({name: dt, "plain": plain, "given": given})
            tg = dtensor.target(name, dt)
            (via,) = targets({name: dt})  # a fetch destination holding the DTensor itself
            result[name] = {
                "rw": rw, "plain": "plain" in got and got["plain"] is plain, "given": got.get("given") is given,
                "part": None if name not in got else (got[name].box, got[name].global_shape,
                                                      got[name].tensor.clone(),
                                                      _same_memory(got[name].tensor, dt.to_local())),
                "target": ([(s.name, s.box, s.global_shape) for s in tg.slots],
                           _same_memory(tg.tensor, dt.to_local()), tg.tensor.clone()),
                "via_targets": ([(x.name, x.box) for x in via.slots], _same_memory(via.tensor, dt.to_local())),
            }
        errors = {}
        mesh = meshes[(world,)]
        partial = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
        nc = DTensor.from_local(torch.ones(3, 2).t(), mesh, [Replicate()], run_check=False)
        strided = DTensor.from_local(torch.ones(4, 2), mesh, [_StridedShard(0, split_factor=2)], run_check=False)
        other = init_device_mesh("cpu", (2, world // 2))
        for key, sd in {"partial": {"p": partial}, "noncontig": {"nc": nc}, "strided": {"st": strided},
                        "two_meshes": {"a": distribute_tensor(full((4,)), mesh, [Replicate()]),
                                       "b": distribute_tensor(full((4,)), other, [Replicate()] * 2)}}.items():
            try:
                dtensor.parts(sd)
                errors[key] = None
            except LayoutError as e:
                errors[key] = str(e)
        try:
            dtensor.target("p", partial)
            errors["target_partial"] = None
        except LayoutError as e:
            errors["target_partial"] = str(e)
        result["errors"] = errors
    except BaseException:
        result = {"traceback": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")


def run_ranks(world: int, tmp_path) -> list[dict]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + JOIN_S  # one bound for all ranks, not JOIN_S each
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} of {world} did not finish within {JOIN_S}s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    died = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    assert not died, f"ranks of {world} exited with codes {died} (rank: code)"
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        assert "traceback" not in res, f"rank {r}:\n{res['traceback']}"
    return results


def region(t, box: Box):
    return t[tuple(slice(o, e) for o, e in zip(box.offsets, box.ends))]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request, tmp_path_factory):
    """One spawn per world for every check below (starting processes is the cost)."""
    world = request.param
    return world, run_ranks(world, tmp_path_factory.mktemp(f"world{world}"))


def test_parts_cover_and_targets_are_local_boxes(ranks):
    world, results = ranks
    for name, (mshape, gshape, spec) in CASES[world].items():
        g = full(gshape)
        boxes = []
        for r, res in enumerate(results):
            got = res[name]
            assert got["rw"] == (r, world), name  # row-major coordinate = global rank here
            # A plain tensor beside DTensors (an FSDP2 buffer) is mesh rank 0's alone,
            # published as it is; a Part's box is its caller's: every rank keeps its own.
            assert got["plain"] == (r == 0), (name, r)
            assert got["given"], (name, r)
            if got["part"] is not None:
                box, gs, tensor, in_place = got["part"]
                assert gs == tuple(gshape)
                assert torch.equal(tensor, region(g, box)), (name, r)
                assert in_place, (name, r)  # a view of the local tensor, not a copy
                boxes.append(box)
            slots, same, local = got["target"]
            # The target is this rank's local shard, and its box holds exactly that.
            assert same, (name, r)
            assert got["via_targets"] == ([(s[0], s[1]) for s in slots], True), (name, r)
            if slots:
                ((sname, sbox, sgs),) = slots
                assert (sname, sgs) == (name, tuple(gshape))
                assert torch.equal(local, region(g, sbox)), (name, r)
            else:
                assert local.numel() == 0, (name, r)
        assert cover_problems(name, gshape, boxes) == [], (name, boxes)
    errors = results[0]["errors"]
    assert "partial sum" in errors["partial"] and "partial sum" in errors["target_partial"]
    assert "nc: local tensor is not contiguous" in errors["noncontig"]
    assert "st: mesh dim 0 is _StridedShard" in errors["strided"]
    assert "b: on mesh" in errors["two_meshes"]


def test_uneven_and_replicated_boxes(ranks):
    """The exact boxes: who publishes what of a replica or a short shard."""
    world, results = ranks

    def published(name):
        return [res[name]["part"] and res[name]["part"][0] for res in results]

    if world == 2:
        assert published("uneven") == [Box((0, 0), (3, 2)), Box((3, 0), (2, 2))]
        assert published("rep") == [Box((0, 0), (3, 3)), Box((3, 0), (2, 3))]
        assert all(res["rep"]["target"][0] == [("rep", Box((0, 0), (5, 3)), (5, 3))] for res in results)
        return
    # 5 rows over 4 ranks: 2, 2, 1 and nothing (the last rank publishes nothing of it).
    assert published("uneven") == [Box((0, 0), (2, 2)), Box((2, 0), (2, 2)), Box((4, 0), (1, 2)), None]
    assert results[3]["uneven"]["target"][0] == []
    # Replicate over 4: 6 rows cut 2, 2, 2, 0; every rank's target is still its whole copy.
    assert published("rep") == [Box((0, 0), (2, 2)), Box((2, 0), (2, 2)), Box((4, 0), (2, 2)), None]
    assert all(res["rep"]["target"][0] == [("rep", Box((0, 0), (6, 2)), (6, 2))] for res in results)
    # 2x2, (Shard(0), Replicate): mesh row i holds rows 3i..3i+3; its two replicas split them 2 + 1.
    assert published("mesh2d") == [Box((0, 0), (2, 3)), Box((2, 0), (1, 3)), Box((3, 0), (2, 3)), Box((5, 0), (1, 3))]
    # 2x2, (Replicate, Shard(1)): the replicas sit on mesh dim 0: ranks 0 and 2 split columns 0..2.
    # 2x2, both Replicate: four replicas in row-major mesh order cut 5 rows 2, 2, 1, 0.
    assert published("mesh2d_rr") == [Box((0, 0), (2, 3)), Box((2, 0), (2, 3)), Box((4, 0), (1, 3)), None]
    assert published("mesh2d_rs") == [Box((0, 0), (2, 2)), Box((0, 2), (2, 2)), Box((2, 0), (1, 2)), Box((2, 2), (1, 2))]


def test_plain_state_dict_passes_through():
    sd = {"a": torch.ones(2), "b": torch.zeros(3, 1)}
    got, rw = parts(sd)
    assert rw is None and got.keys() == sd.keys() and all(got[k] is sd[k] for k in sd)


def test_plain_tensors_never_import_dtensor_and_a_dtensor_is_still_recognised():
    """Asking whether a value is a DTensor imports nothing (the import cost a reader's
    first fetch seconds of CPU); once DTensors exist, they are recognised."""
    import subprocess
    import sys

    code = """
import sys, torch
from tensorhub_cli.endpoint import layouts
plain = {"w": torch.zeros(4)}
assert layouts.published(plain, None) == (plain, (0, 1))
assert not layouts._is_dtensor(plain["w"])
assert "torch.distributed.tensor" not in sys.modules, "asking imported torch.distributed.tensor"
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
d = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Replicate()])
assert layouts._is_dtensor(d) and not layouts._is_dtensor(plain["w"])
dist.destroy_process_group()
""" % free_port()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
