"""Contract 9 at the default chunking: a vLLM TP worker of a small Llama reads its shard,
not ~2x it (``chunking.grid_for``, ``chunking.compact``).

The manifest is laid out as a trainer publishes it, with ``lay_out``'s defaults
(16 MiB chunks, 1 MiB compaction threshold, 256 KiB tiles); each TP rank's fused
q/k/v, gate/up and row/column slices (``vllm_llama``) are planned by ``place_boxes``
and the bytes it would read are summed. The model is the one ``th bench rl --workload
vllm`` runs (hidden 512, 4 heads over 2 KV heads, a 253-word vocabulary). The grid's
chunk and tile counts for big models are checked on shapes alone (no memory).
"""

from __future__ import annotations

from math import ceil
from types import SimpleNamespace

import pytest
import torch

from tensorhub_cli.layout import vllm_llama
from tensorhub_cli.layout.chunking import CHUNK_BYTES, MAX_TILES, TILE_BYTES, grid_for, lay_out, rows_of
from tensorhub_cli.layout.overlap import place_boxes

from .test_layout_overlap import move

BENCH = SimpleNamespace(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=2, vocab_size=253, tie_word_embeddings=False)


def published(config):
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in vllm_llama.global_shapes(config).items()}
    manifest, placed = lay_out(full)  # (the defaults: what a trainer's publish uses)
    return full, manifest, placed


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp2_worker_of_a_small_llama_reads_at_most_105_percent_of_its_shard(rank):
    full, manifest, source = published(BENCH)
    params = vllm_llama.params(BENCH, rank, 2, torch.float32)
    targets = list(vllm_llama.targets(params, BENCH, rank, 2).values())
    shard = sum(s.view.nbytes for t in targets for s in t.slots)
    reader = place_boxes([manifest], targets)
    needed = sum(reader.read_bytes(g) for g in reader.wanted)
    assert needed / shard <= 1.05, (f"rank {rank} of 2 reads {needed} B for a {shard} B shard "
                                    f"({needed / shard:.2f}x)")
    assert move([manifest], [source], reader) == needed
    want = vllm_llama.reference(full, BENCH, rank, 2)
    assert all(torch.equal(params[n], want[n]) for n in want)  # (and bit for bit)


# (rows, columns, element size): a 70B's projections and vocabulary, a Llama-2-7B's MLP
# (11008 rows: a segment with 2^5 in it), Qwen2.5's vocabulary, a Mixtral expert stack.
BIG = [((8192, 8192), 2), ((1024, 8192), 2), ((28672, 8192), 2), ((8192, 28672), 2), ((128256, 8192), 2),
       ((11008, 4096), 2), ((4096, 11008), 2), ((152064, 3584), 2), ((8, 14336, 4096), 2), ((8192,), 4)]


@pytest.mark.parametrize("shape, elem", BIG)
def test_a_big_models_grid_keeps_its_chunk_count_and_puts_every_tp_edge_on_a_block_edge(shape, elem):
    grid = grid_for(shape, elem)
    rows, per_row = rows_of(shape)
    row_bytes = per_row * elem
    whole_rows = ceil(rows / (CHUNK_BYTES // row_bytes))  # what whole-row chunks gave
    # (a chunk loses under one block of rows, a block being at most an eighth of it)
    assert ceil(rows / grid.step) <= ceil(whole_rows * 8 / 7), grid
    chunk_rows = min(rows, grid.step)
    assert ceil(chunk_rows / grid.tile_rows) * grid.strips <= MAX_TILES, grid
    assert grid.tile_rows * row_bytes // grid.strips <= TILE_BYTES, grid
    for world in (2, 4, 8):
        if rows % world == 0 and len(shape) > 1:
            assert (rows // world) % grid.tile_rows == 0, (world, grid)
        if per_row % world == 0 and len(shape) > 1:
            assert world <= grid.strips and grid.strips % world == 0, (world, grid)


def test_an_odd_vocabulary_rounds_by_under_one_small_block():
    grid = grid_for((253, 512), 4)
    assert grid.tile_rows <= 4 and ceil(253 / grid.tile_rows) * grid.strips <= MAX_TILES, grid
