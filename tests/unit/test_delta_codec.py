"""The chunk delta codec: round trips, refusals that name what is wrong, and `th bench delta`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorhub_cli.delta import codec
from tensorhub_cli.delta.codec import DeltaError, decode, encode, rebuild_verified
from tensorhub_cli.layout.checksum import digest

METHODS = codec.METHODS


def _bf16_chunk(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 0.02).bfloat16()
    return w.view(torch.int16).numpy().view(np.uint16).copy()


def _step(old: np.ndarray, share: float, seed: int = 1) -> np.ndarray:
    """``old`` with ``share`` of its bf16 elements moved one ulp, as between RL steps."""
    rng = np.random.default_rng(seed)
    new = old.copy()
    idx = np.flatnonzero(rng.random(old.size) < share)
    new[idx] += np.where(rng.random(idx.size) < 0.5, 1, -1).astype(np.uint16)
    return new


@pytest.mark.parametrize("method", METHODS)
def test_sparse_changes_round_trip_and_are_small(method):
    old = _bf16_chunk(1 << 16)
    new = _step(old, 0.02)
    d = encode(old, new, method=method)
    assert d is not None and len(d) < 0.1 * new.nbytes
    assert decode(old, d) == new.tobytes()


@pytest.mark.parametrize("method", METHODS)
def test_many_random_changes_round_trip(method):
    rng = np.random.default_rng(3)
    old = _bf16_chunk(1 << 15)
    new = old.copy()
    idx = rng.choice(old.size, old.size // 5, replace=False)
    new[idx] = rng.integers(0, 1 << 16, idx.size, dtype=np.uint16)
    d = encode(old, new, method=method)
    assert d is not None
    assert decode(old, d) == new.tobytes()


@pytest.mark.parametrize("method", METHODS)
def test_a_delta_not_smaller_than_the_chunk_is_none(method):
    rng = np.random.default_rng(4)
    old = rng.integers(0, 256, 1 << 14, dtype=np.uint8)
    new = rng.integers(0, 256, 1 << 14, dtype=np.uint8)  # nothing in common
    assert encode(old, new, method=method) is None
    assert encode(old[:8], new[:8], method=method) is None  # the header alone is as big
    assert encode(b"", b"", method=method) is None


@pytest.mark.parametrize("method", METHODS)
def test_identical_chunks_give_a_tiny_delta(method):
    old = _bf16_chunk(1 << 18)
    d = encode(old, old.copy(), method=method)
    assert d is not None and len(d) <= codec.HEADER_BYTES + 64
    assert decode(old, d) == old.tobytes()


def test_inputs_may_be_bytes_memoryviews_and_cpu_tensors():
    old = _bf16_chunk(4096)
    new = _step(old, 0.05)
    d = encode(memoryview(old.tobytes()), torch.from_numpy(new.view(np.int16)))
    assert decode(torch.from_numpy(old.view(np.int16)).view(torch.uint8), d) == new.tobytes()
    as_bf16 = torch.from_numpy(new.view(np.int16)).view(torch.bfloat16).reshape(64, 64)
    assert decode(old, encode(old, as_bf16)) == new.tobytes()
    odd_old, odd_new = old.tobytes()[:-1], new.tobytes()[:-1]  # an odd size: byte elements
    assert decode(odd_old, encode(odd_old, odd_new)) == odd_new


def test_encode_refuses_chunks_of_different_sizes_and_unknown_methods():
    old = _bf16_chunk(1024)
    with pytest.raises(DeltaError, match=r"old chunk has 2048 bytes and new chunk 2046"):
        encode(old, old.tobytes()[:-2])
    with pytest.raises(DeltaError, match=r"method: 'gzip' is not one of sparse, xor"):
        encode(old, old, method="gzip")
    with pytest.raises(DeltaError, match=r"old: not contiguous"):
        encode(old[::2], old[::2])
    with pytest.raises(DeltaError, match=r"new: int is not a byte buffer"):
        encode(old, 7)


@pytest.fixture(params=METHODS)
def pair(request):
    old = _bf16_chunk(1 << 14)
    new = _step(old, 0.05)
    return old, new, encode(old, new, method=request.param)


def test_a_frame_that_does_not_fit_the_chunk_is_refused(pair):
    import zstandard

    old, _, d = pair
    header = d[:codec.HEADER_BYTES]
    with pytest.raises(DeltaError, match=r"its frame declares 1000000 bytes, at most \d+ fit this chunk"):
        decode(old, header + zstandard.ZstdCompressor().compress(bytes(1000000)))
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = unsized.compress(bytes(10)) + unsized.flush()
    with pytest.raises(DeltaError, match=r"its frame does not declare its size"):
        decode(old, header + frame)


def test_a_delta_for_another_size_is_refused(pair):
    old, _, d = pair
    with pytest.raises(DeltaError, match=r"made for a chunk of 32768 bytes, the old chunk has 32766"):
        decode(old.tobytes()[:-2], d)


def test_a_delta_against_other_old_bytes_is_refused(pair):
    old, _, d = pair
    other = old.copy()
    other[5] ^= 1
    with pytest.raises(DeltaError, match=r"made against other old bytes"):
        decode(other, d)


@pytest.mark.parametrize("cut", [0, 10, codec.HEADER_BYTES, codec.HEADER_BYTES + 5, -1])
def test_a_truncated_delta_is_refused(pair, cut):
    old, _, d = pair
    with pytest.raises(DeltaError, match=r"truncated|cut short|shorter than its"):
        decode(old, d[:cut])


def test_not_a_delta_is_refused_by_name(pair):
    old, _, d = pair
    with pytest.raises(DeltaError, match=r"starts with b'PK\\x03\\x04', not b'THDL': not a chunk delta"):
        decode(old, b"PK\x03\x04" + d[4:])
    future = bytearray(d)
    future[4] = 9
    with pytest.raises(DeltaError, match=r"format 9, method \d, unit 2 is not one this reader knows"):
        decode(old, bytes(future))


def test_a_corrupt_delta_never_yields_wrong_bytes(pair):
    """Flip each byte of the frame in turn: every decode either rebuilds the new chunk
    exactly or raises DeltaError."""
    old, new, d = pair
    wrong = 0
    for i in range(codec.HEADER_BYTES, len(d), max(1, len(d) // 200)):
        bad = bytearray(d)
        bad[i] ^= 0x41
        try:
            got = decode(old, bytes(bad))
        except DeltaError:
            continue
        wrong += got != new.tobytes()
    assert wrong == 0


def test_the_new_chunks_hash_is_checked_after_rebuilding(pair):
    old, _, d = pair
    bad = bytearray(d)
    bad[24] ^= 1  # the header's XXH3 of the new chunk
    with pytest.raises(DeltaError, match=r"rebuilt chunk's XXH3 is not the new chunk's"):
        decode(old, bytes(bad))


@pytest.mark.parametrize("kind", ["xxh3", "dev64"])
def test_rebuild_verified_checks_the_manifest_digest(kind):
    old = _bf16_chunk(1 << 12)
    new = _step(old, 0.05)
    want = digest(torch.from_numpy(new.view(np.uint8)), kind)
    d = encode(old, new)
    assert rebuild_verified(old, d, want, kind) == new.tobytes()
    with pytest.raises(DeltaError, match=rf"rebuilt chunk: {kind} digest 0x[0-9a-f]+ is not the manifest's"):
        rebuild_verified(old, d, want ^ 1, kind)
    with pytest.raises(DeltaError, match=r"kind: 'md5' is not a digest"):
        rebuild_verified(old, d, want, "md5")


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(METHODS))
def test_round_trip_for_any_old_and_new_of_equal_length(data, method):
    old = data.draw(st.binary(max_size=600), label="old")
    n = len(old)
    edits = data.draw(st.lists(st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 255)), max_size=n),
                      label="edits")
    new = bytearray(old)
    for i, v in edits if n else ():
        new[i] = v
    if data.draw(st.booleans(), label="unrelated"):
        new = bytearray(data.draw(st.binary(min_size=n, max_size=n), label="new"))
    d = encode(old, bytes(new), method=method)
    if d is None:
        return
    assert len(d) < n
    assert decode(old, d) == bytes(new)


def _tiny_trace(tmp_path):
    step = {"step": 1, "changed_share": 0.02, "by_class": {"attention": 0.02, "mlp": 0.03, "norm": 0.0,
                                                           "embed": 0.01},
            "ulps": {"1": 0.9, "2": 0.05, "3-4": 0.03, "5+": 0.02, "sign": 0.0}}
    shapes = {"model.embed_tokens.weight": [256, 64], "model.layers.0.self_attn.q_proj.weight": [64, 64],
              "model.layers.0.mlp.up_proj.weight": [128, 64], "model.norm.weight": [64]}
    doc = {"command": "test", "date": "2026-12-05", "result": {
        "workload": "delta-trace", "model": {"params": 0, "shapes": shapes},
        "runs": [{"lr": 1e-6, "steps": [step, {**step, "step": 2}]}]}}
    path = tmp_path / "delta-trace-tiny.json"
    path.write_text(json.dumps(doc))
    return path


def test_bench_delta_prints_per_step_rows_and_the_top_level_ratios(tmp_path):
    from typer.testing import CliRunner

    from tensorhub_cli.cli import app

    result = CliRunner().invoke(app, ["bench", "delta", "--json", "--trace", str(_tiny_trace(tmp_path)),
                                      "--chunk-kib", "8", "--steps", "2"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout.strip().splitlines()[-1])
    assert [s["step"] for s in r["steps"]] == [1, 2]
    for s in r["steps"]:
        assert s["full_bytes"] == 2 * (256 * 64 + 64 * 64 + 128 * 64 + 64)
        assert 0 < s["delta_bytes"] < s["full_bytes"] and s["ratio"] == s["delta_bytes"] / s["full_bytes"]
        assert s["encode_mb_s"] > 0 and s["decode_mb_s"] > 0
    assert 0 < r["delta"]["bytes_ratio"] < 0.25 and r["delta"]["decode_mbps"] > 0 and r["wrong_bytes"] == 0


def test_bench_delta_refuses_a_learning_rate_the_trace_lacks(tmp_path):
    from typer.testing import CliRunner

    from tensorhub_cli.cli import app

    result = CliRunner().invoke(app, ["bench", "delta", "--json", "--trace", str(_tiny_trace(tmp_path)),
                                      "--lr", "1e-3"])
    assert result.exit_code == 1
    assert "--lr 0.001: the trace has runs at 1e-06 only" in result.output
