"""Layouts: publish cuts a state_dict into chunks without copying large tensors; a
reader maps any manifest onto its own tensors; mismatches are listed, all at once."""

from __future__ import annotations

import pytest
import torch

from tensorhub_cli.layout import LayoutError, lay_out, place


def state_dict():
    g = torch.Generator().manual_seed(1)
    return {"emb": torch.randn(300, 1000, generator=g), "bias": torch.randn(10, generator=g),
            "step": torch.tensor([3]), "half": torch.randn(2, 3, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0), "w": torch.randn(70_000, generator=g)}


def test_large_tensors_are_chunked_in_place_and_small_ones_share_a_staging_chunk():
    sd = state_dict()
    m, placed = lay_out(sd, chunk_bytes=256 << 10, small_bytes=64 << 10)
    assert [t.name for t in m.tensors] == list(sd)  # manifest order is the state_dict's
    big = {r.addr for r in placed.regions}
    assert sd["emb"].data_ptr() in big and sd["w"].data_ptr() in big  # registered where they lie
    assert sum(c.nbytes for c in m.chunks) == sum(t.nbytes for t in sd.values())
    emb = next(t for t in m.tensors if t.name == "emb")
    assert emb.offset == sum(t.nbytes for n, t in sd.items() if t.nbytes < 64 << 10)  # after the staging area
    assert all(0 < c.nbytes <= 256 << 10 for c in m.chunks)


def test_a_reader_gets_every_byte_through_direct_and_staged_chunks():
    sd = state_dict()
    m, src = lay_out(sd, chunk_bytes=256 << 10, small_bytes=64 << 10)
    dst = {k: torch.full_like(v, 7) for k, v in sd.items()}
    placed = place([m], dst)
    assert placed.scatter  # the small tensors arrive through a staging chunk
    for c, meta in enumerate(m.chunks):
        placed.views[c].copy_(src.views[c])  # what an engine read does
        assert placed.checksum(c) == meta.checksum
        placed.finish(c)
    assert all(torch.equal(sd[k], dst[k]) for k in sd)


def test_every_mismatch_is_listed_and_nothing_is_written():
    m, _ = lay_out(state_dict(), chunk_bytes=256 << 10, small_bytes=64 << 10)
    dst = {k: torch.zeros_like(v) for k, v in state_dict().items()}
    dst["emb"] = torch.zeros(300, 999)
    dst["w"] = torch.zeros(70_000, dtype=torch.float64)
    dst["extra"] = torch.zeros(1)
    del dst["bias"]
    dst["half"] = torch.zeros(3, 2, dtype=torch.bfloat16).t()  # right shape, not contiguous
    before = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(LayoutError) as err:
        place([m], dst)
    problems = err.value.problems
    assert "bias: missing from the destination" in problems
    assert "extra: not in the manifest" in problems
    assert "emb: shape [300, 999], manifest has [300, 1000]" in problems
    assert "w: dtype float64, manifest has float32" in problems
    assert "half: not contiguous" in problems
    assert all(torch.equal(before[k], dst[k]) for k in dst)


def test_publishing_what_cannot_register_names_each_tensor():
    bad = {"t": torch.zeros(4, 4).t(), "x": [1, 2]}
    with pytest.raises(LayoutError) as err:
        lay_out(bad)
    assert any(p.startswith("t: not contiguous") for p in err.value.problems)
    assert "x: not a tensor (list)" in err.value.problems
    with pytest.raises(LayoutError, match="empty"):
        lay_out({})


def test_shards_map_to_global_chunks_rank_zero_first():
    a = {"a": torch.arange(1000, dtype=torch.int32)}
    b = {"b": torch.arange(3000, dtype=torch.int32)}
    ma, pa = lay_out(a, chunk_bytes=1024, small_bytes=1)
    mb, pb = lay_out(b, chunk_bytes=1024, small_bytes=1)
    dst = {"a": torch.zeros(1000, dtype=torch.int32), "b": torch.zeros(3000, dtype=torch.int32)}
    placed = place([ma, mb], dst)
    sources = pa.views + pb.views
    assert len(placed.views) == len(sources) == len(ma.chunks) + len(mb.chunks)
    for c, view in enumerate(sources):
        placed.views[c].copy_(view)
        placed.finish(c)
    assert torch.equal(dst["a"], a["a"]) and torch.equal(dst["b"], b["b"])


def test_verify_re_hashes_the_destination_and_names_the_chunk_that_changed():
    import torch

    from tensorhub_cli.layout import lay_out, verify

    src = {"big": torch.arange(300_000, dtype=torch.float32), "small": torch.ones(10), "bias": torch.zeros(3)}
    manifest, _ = lay_out(src, chunk_bytes=1 << 18, small_bytes=1 << 10)
    copy = {k: v.clone() for k, v in src.items()}
    assert verify([manifest], copy) == []
    copy["big"][200_000] += 1  # a byte in the big tensor's chunk 3 (4-byte floats, 256 KiB chunks)
    copy["bias"][1] = 5.0  # a byte in the compacted small-tensor chunk
    problems = verify([manifest], copy)
    assert len(problems) == 2
    assert any("chunk 0 (small, bias)" in msg for msg in problems)
    assert any("(big)" in msg for msg in problems)
    assert verify([manifest], {"big": copy["big"]})[0].startswith("bias: missing")


@pytest.mark.parametrize("nbytes", [0, 1, 17, 240, 241, 1024, (1 << 20) + 3])
def test_checksum_is_the_manifest_digest_xxh3_64_of_the_bytes(nbytes):
    import xxhash

    from tensorhub_cli.layout import checksum

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert checksum(data) == xxhash.xxh3_64_intdigest(data.numpy().tobytes())


def test_the_layout_modules_import_no_circle():
    """Every import between ``tensorhub_cli/layout`` modules, function-level ones too,
    goes one way (a circle made ``targets`` import ``dtensor`` inside a function)."""
    import ast
    from pathlib import Path

    import tensorhub_cli.layout as pkg

    root = Path(pkg.__file__).parent
    edges = {}
    for path in root.glob("*.py"):
        mod = path.stem
        edges[mod] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:  # from .x import y
                    edges[mod].add(node.module.split(".")[0])
                else:  # from . import x, y
                    edges[mod].update(a.name for a in node.names)
    edges.pop("__init__")
    edges = {m: {d for d in ds if d in edges and d != m} for m, ds in edges.items()}

    def circle(m, path):
        if m in path:
            return path[path.index(m):] + [m]
        for d in sorted(edges[m]):
            if found := circle(d, path + [m]):
                return found
        return None

    for m in sorted(edges):
        assert circle(m, []) is None, " -> ".join(circle(m, []))
