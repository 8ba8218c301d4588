"""dev64, the device-side chunk digest: equal bytes give one digest whatever the block
size or alignment, and it matches an independent numpy copy of its arithmetic (so a
CUDA run only has to agree with CPU); a flipped bit, a shift or swapped words change
it; manifests say which digest each chunk carries, and readers verify with that one."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.layout import LayoutError, digest_for, lay_out, place, verify
from tensorhub_cli.layout.devdigest import bench_digest, dev64

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
M = (1 << 64) - 1


def reference(data: bytes) -> int:
    """The documented arithmetic in numpy uint64 (logical shifts, wrapping products),
    written apart from the torch int64 version. The constants are part of the format."""
    k1, k2, k3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
    s33 = np.uint64(33)

    def fmix(x):
        x = x ^ (x >> s33)
        x = x * k2
        x = x ^ (x >> s33)
        x = x * k3
        return x ^ (x >> s33)

    n = len(data)
    with np.errstate(over="ignore"):
        w = np.frombuffer(data + bytes(-n % 8), dtype="<u8")
        h = fmix(w + np.arange(1, len(w) + 1, dtype=np.uint64) * k1)
        total = int(h.sum(dtype=np.uint64))
        return int(fmix(np.array([(total + n * int(k1)) & M], dtype=np.uint64))[0])


def tensor(data: bytes, shift: int = 0) -> torch.Tensor:
    """``data`` as a flat uint8 view starting ``shift`` bytes into its buffer."""
    buf = torch.zeros(len(data) + shift + 8, dtype=torch.uint8)
    view = buf[shift:shift + len(data)]
    if data:
        view.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return view


blocks = st.integers(1, 12).map(lambda k: 8 * k)


@FAST
@given(data=st.binary(max_size=700), block=blocks, shift=st.integers(0, 7))
def test_equal_bytes_give_the_reference_digest_at_any_block_size_and_alignment(data, block, shift):
    want = reference(data)
    assert dev64(tensor(data, shift), block_bytes=block) == want
    assert dev64(tensor(data)) == want  # one 16 MiB block, aligned


@FAST
@given(data=st.binary(min_size=1, max_size=400), where=st.integers(0), block=blocks)
def test_any_single_flipped_bit_changes_the_digest(data, where, block):
    bit = where % (8 * len(data))
    flipped = bytearray(data)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert dev64(tensor(bytes(flipped)), block_bytes=block) != dev64(tensor(data), block_bytes=block)


@FAST
@given(data=st.binary(min_size=2, max_size=400))
def test_a_shift_by_one_byte_changes_the_digest(data):
    rotated, inserted = data[1:] + data[:1], b"\0" + data[:-1]  # same length, bytes one offset off
    assume(rotated != data and inserted != data)
    assert dev64(tensor(rotated)) != dev64(tensor(data))
    assert dev64(tensor(inserted)) != dev64(tensor(data))


@FAST
@given(data=st.binary(min_size=16, max_size=400), i=st.integers(0), j=st.integers(0))
def test_swapped_words_change_the_digest(data, i, j):
    words = len(data) // 8
    i, j = i % words, j % words
    a, b = data[8 * i:8 * i + 8], data[8 * j:8 * j + 8]
    assume(a != b)
    swapped = bytearray(data)
    swapped[8 * i:8 * i + 8], swapped[8 * j:8 * j + 8] = b, a
    assert dev64(tensor(bytes(swapped))) != dev64(tensor(data))


def test_zero_padding_and_length_count():
    data = bytes(range(13))
    assert len({dev64(tensor(data)), dev64(tensor(data + b"\0")), dev64(tensor(data + bytes(3)))}) == 3
    assert dev64(tensor(b"")) == reference(b"")


def test_blocks_span_many_lanes_with_big_data():
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, ((1 << 20) + 5,), dtype=torch.uint8, generator=g)
    want = reference(data.numpy().tobytes())
    assert dev64(data) == dev64(data, block_bytes=4096) == want
    assert dev64(data[3:]) == reference(data.numpy().tobytes()[3:])  # unaligned: copied block by block


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="view"):
        dev64(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="view"):
        dev64(torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="block_bytes"):
        dev64(torch.zeros(8, dtype=torch.uint8), block_bytes=12)
    with pytest.raises(ValueError, match="nbytes"):
        bench_digest(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_the_cpu_digest():
    g = torch.Generator().manual_seed(5)
    for n in (1, 7, 8, 4099, (3 << 20) + 1):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert dev64(data.cuda(), block_bytes=1 << 20) == dev64(data) == reference(data.numpy().tobytes())
        assert dev64(data.cuda()[1:]) == dev64(data[1:])


def test_bench_digest_reports_a_rate():
    assert bench_digest(1 << 16, device="cpu", repeats=1) > 0


# --- the manifest names the digest; readers verify with it ------------------------------


def state_dict():
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(40_000, generator=g), "b": torch.randn(7, generator=g),
            "step": torch.tensor([3], dtype=torch.int8), "v": torch.randn(9_001, generator=g)}


def test_the_manifest_records_each_chunks_digest_kind():
    sd = state_dict()
    m, placed = lay_out(sd, chunk_bytes=1 << 15, small_bytes=1 << 10, digest="dev64")
    assert {c.digest for c in m.chunks} == {"dev64"} and placed.digests == ["dev64"] * len(m.chunks)
    assert [c.checksum for c in m.chunks] == [dev64(v) for v in placed.views]
    host, _ = lay_out(sd, chunk_bytes=1 << 15, small_bytes=1 << 10)
    assert {c.digest for c in host.chunks} == {"xxh3"}  # host tensors: XXH3 by default
    assert (digest_for(-1), digest_for(0), digest_for(3)) == ("xxh3", "dev64", "dev64")
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=p.Manifest)
    assert again == m


def test_old_manifests_decode_as_xxh3_and_host_ones_encode_as_before():
    old = {"tensors": [], "chunks": [{"nbytes": 8, "checksum": 5}], "chunk_bytes": 8}
    m = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=p.Manifest)
    assert m.chunks[0].digest == "xxh3"
    assert msgspec.msgpack.encode(m) == msgspec.msgpack.encode(old)  # the default is not on the wire
    with pytest.raises(msgspec.ValidationError, match="digest"):
        bad = {**old, "chunks": [{"nbytes": 8, "checksum": 5, "digest": "md5"}]}
        msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=p.Manifest)


def test_lay_out_refuses_an_unknown_digest_kind():
    with pytest.raises(LayoutError) as err:
        lay_out(state_dict(), digest="md5")
    assert any(p.startswith("digest: 'md5'") for p in err.value.problems)


def test_a_reader_verifies_dev64_chunks_and_catches_a_flipped_bit():
    sd = state_dict()
    m, src = lay_out(sd, chunk_bytes=1 << 15, small_bytes=1 << 10, digest="dev64")
    dst = {k: torch.zeros_like(v) for k, v in sd.items()}
    placed = place([m], dst)
    assert placed.scatter and placed.digests == ["dev64"] * len(m.chunks)
    bad = 2
    for c, meta in enumerate(m.chunks):
        placed.views[c].copy_(src.views[c])  # what an engine read does
        if c == bad:
            placed.views[c][1234] ^= 0x10  # corrupted in transit
            assert placed.checksum(c) != meta.checksum
            placed.views[c].copy_(src.views[c])  # re-read elsewhere
        assert placed.checksum(c) == meta.checksum
        placed.finish(c)
    assert all(torch.equal(sd[k], dst[k]) for k in sd)
    assert verify([m], dst) == []  # re-hashed as dev64, the staged chunk joined where it lies
    dst["b"].view(torch.int32)[3] ^= 1 << 20  # inside the compacted small-tensor chunk
    dst["v"].view(torch.uint8)[-1] ^= 0x80  # the last byte of the last chunk
    problems = verify([m], dst)
    assert len(problems) == 2
    assert any("chunk 0 (b, step)" in msg for msg in problems) and any("(v)" in msg for msg in problems)
