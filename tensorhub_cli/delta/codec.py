"""Chunk deltas: a chunk of version v+1 encoded as what changed against the same chunk of v.

Protocol. ``encode(old, new)`` takes two equal-sized chunks (anything with the buffer
protocol: bytes, memoryview, a contiguous numpy array; a CPU torch tensor) and returns
the delta as bytes, or ``None`` when the delta would not be smaller than ``new`` (send
the full chunk then). ``decode(old, delta)`` returns ``new``'s bytes. ``rebuild_verified
(old, delta, expected_digest, kind)`` decodes and checks the result against the chunk
digest of v+1's manifest (``layout.checksum``, contract 5: the digest is of the full
chunk): only a chunk that passes counts.

A delta is a 32-byte header and a zstd frame. The header holds a magic, the format
version, the method, the element width (2 bytes: bf16 and fp16, the weights' usual
width; 1 for an odd-sized chunk), the chunk size, and XXH3-64 of the old and of the
new chunk. ``decode`` refuses, naming what is wrong, a delta that is not one, one for
another chunk size, one made against other old bytes, a truncated or corrupt frame,
and a result whose hash is not the new chunk's: it never returns wrong bytes. The
methods (element-wise XOR of old and new, x):

- ``sparse`` (the default): the positions of x's nonzero elements, as gaps between
  consecutive positions (uint32), and x's values there; each field's bytes split into
  planes (all low bytes, then the next ...) so the compressor sees runs of zeros.
- ``xor``: x itself, its bytes split into planes the same way, compressed whole.

Between RL steps most bf16 elements do not change and those that do move by one unit in
the last place, so x is mostly zero and its nonzero values small. ``sparse`` hands the
compressor only the changed elements: smaller and faster to rebuild on the traces
measured (docs/design.md, "Deltas: the codec and the trace"). Pure functions, no state
but a per-thread compressor cache; safe from any thread.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import xxhash
import zstandard

from ..errors import TensorHubError

METHODS = ("sparse", "xor")
DEFAULT_METHOD = "sparse"
DEFAULT_LEVEL = 1
MAGIC = b"THDL"
FORMAT = 1
_HEADER = struct.Struct("<4sBBBxQQQ")  # magic, format, method, unit, size, old xxh3, new xxh3
HEADER_BYTES = _HEADER.size
_GAP = np.dtype("<u4")
_UNIT = {1: np.dtype("u1"), 2: np.dtype("<u2")}
_local = threading.local()


class DeltaError(TensorHubError, ValueError):
    """A delta cannot be made or applied: the message names what is wrong. The reader
    re-reads such a chunk in full."""


def encode(old, new, method: str = DEFAULT_METHOD, level: int = DEFAULT_LEVEL) -> bytes | None:
    """The delta that turns ``old`` into ``new``, or None when it is not smaller than ``new``."""
    a, b = _bytes_of(old, "old"), _bytes_of(new, "new")
    if a.size != b.size:
        raise DeltaError(f"old chunk has {a.size} bytes and new chunk {b.size}: a delta joins two versions "
                         "of one chunk (same size)")
    if method not in METHODS:
        raise DeltaError(f"method: {method!r} is not one of {', '.join(METHODS)}")
    unit = 2 if a.size % 2 == 0 else 1
    if method == "sparse" and a.size // unit >= 1 << 32:
        method = "xor"  # gaps are uint32
    x = np.bitwise_xor(a.view(_UNIT[unit]), b.view(_UNIT[unit]))
    body = _sparse_body(x) if method == "sparse" else _planes(x)
    header = _HEADER.pack(MAGIC, FORMAT, METHODS.index(method), unit, a.size, _xxh(a), _xxh(b))
    budget = b.size - len(header)
    if budget <= 0:
        return None
    frame = _compressor(level).compress(body)
    return header + frame if len(frame) < budget else None


def decode(old, delta) -> bytes:
    """The new chunk's bytes: ``delta`` applied to ``old``. Raises ``DeltaError`` naming what is wrong."""
    return rebuild(old, delta).tobytes()


def rebuild(old, delta) -> np.ndarray:
    """``decode``, as a new writable uint8 array (no copy into bytes)."""
    a = _bytes_of(old, "old")
    d = memoryview(_bytes_of(delta, "delta"))
    if len(d) < HEADER_BYTES:
        raise DeltaError(f"delta: {len(d)} bytes is shorter than its {HEADER_BYTES}-byte header (truncated?)")
    magic, fmt, method, unit, size, old_hash, new_hash = _HEADER.unpack_from(d)
    if magic != MAGIC:
        raise DeltaError(f"delta: starts with {bytes(magic)!r}, not {MAGIC!r}: not a chunk delta")
    if fmt != FORMAT or method >= len(METHODS) or unit not in _UNIT:
        raise DeltaError(f"delta: format {fmt}, method {method}, unit {unit} is not one this reader knows "
                         f"(format {FORMAT}, methods {', '.join(METHODS)}, unit 1 or 2)")
    if size != a.size:
        raise DeltaError(f"delta: made for a chunk of {size} bytes, the old chunk has {a.size}")
    if _xxh(a) != old_hash:
        raise DeltaError("delta: made against other old bytes than these (old chunk's XXH3 differs): "
                         "the reader does not hold the version it was made for")
    frame = d[HEADER_BYTES:]
    elems = size // unit
    width = _UNIT[unit].itemsize
    limit = 8 + elems * (_GAP.itemsize + width) if METHODS[method] == "sparse" else size
    body = _decompress(frame, limit)
    out = a.view(_UNIT[unit]).copy()
    if METHODS[method] == "sparse":
        _apply_sparse(out, body, width)
    else:
        if len(body) != size:
            raise DeltaError(f"delta: its XOR holds {len(body)} bytes, the chunk {size}")
        out ^= _unplanes(body, _UNIT[unit], elems)
    rebuilt = out.view(np.uint8)
    if _xxh(rebuilt) != new_hash:
        raise DeltaError("delta: the rebuilt chunk's XXH3 is not the new chunk's (corrupt delta)")
    return rebuilt


def rebuild_verified(old, delta, expected_digest: int, kind: str = "xxh3") -> bytes:
    """``decode`` and check the result against v+1's chunk digest (``ChunkMeta.checksum``
    of the ``kind`` it names); raises ``DeltaError`` unless it matches."""
    from ..layout.checksum import DIGESTS, digest

    if kind not in DIGESTS:
        raise DeltaError(f"kind: {kind!r} is not a digest (one of {', '.join(DIGESTS)})")
    import torch

    new = rebuild(old, delta)
    got = digest(torch.from_numpy(new), kind)
    if got != expected_digest:
        raise DeltaError(f"rebuilt chunk: {kind} digest {got:#x} is not the manifest's {expected_digest:#x}")
    return new.tobytes()


def _bytes_of(x, what: str) -> np.ndarray:
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):  # a torch tensor: its bytes, any dtype
        import torch

        if x.device.type != "cpu":
            raise DeltaError(f"{what}: a tensor on {x.device}; the codec reads host memory")
        x = x.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
        raise DeltaError(f"{what}: not contiguous memory (a chunk is one contiguous byte range)")
    try:
        return np.frombuffer(x, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise DeltaError(f"{what}: {type(x).__name__} is not a byte buffer ({exc})") from None


def _xxh(a: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(a) if a.size else xxhash.xxh3_64_intdigest(b"")


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # Compressor objects may not be shared between threads; making one costs more than
    # compressing a sparse chunk, so each thread keeps one per level.
    cache = _local.__dict__.setdefault("c", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompress(frame: memoryview, limit: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta: its frame is not zstd or cut short ({exc})") from None
    if declared < 0:
        raise DeltaError("delta: its frame does not declare its size (not made by encode)")
    if declared > limit:
        raise DeltaError(f"delta: its frame declares {declared} bytes, at most {limit} fit this chunk")
    d = _local.__dict__.get("d") or _local.__dict__.setdefault("d", zstandard.ZstdDecompressor())
    try:
        return d.decompress(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"delta: its frame does not decompress, truncated or corrupt ({exc})") from None


def _planes(x: np.ndarray) -> bytes:
    """x's bytes as planes: every element's byte 0, then every byte 1, ..."""
    return np.ascontiguousarray(x.view(np.uint8).reshape(x.size, x.itemsize).T).tobytes()


def _unplanes(body: bytes, dtype: np.dtype, n: int) -> np.ndarray:
    planes = np.frombuffer(body, dtype=np.uint8).reshape(dtype.itemsize, n)
    return np.ascontiguousarray(planes.T).view(dtype).reshape(n)


def _sparse_body(x: np.ndarray) -> bytes:
    idx = np.flatnonzero(x)
    gaps = np.diff(idx, prepend=0).astype(_GAP)  # the first "gap" is the first position
    return struct.pack("<Q", idx.size) + _planes(gaps) + _planes(x[idx])


def _apply_sparse(out: np.ndarray, body: bytes, width: int) -> None:
    if len(body) < 8:
        raise DeltaError(f"delta: its sparse body holds {len(body)} bytes, less than its 8-byte count")
    (n,) = struct.unpack_from("<Q", body)
    if len(body) != 8 + n * (_GAP.itemsize + width):
        raise DeltaError(f"delta: its sparse body holds {len(body)} bytes, {n} changes need "
                         f"{8 + n * (_GAP.itemsize + width)}")
    if n == 0:
        return
    gaps = _unplanes(body[8:8 + n * _GAP.itemsize], _GAP, n)
    if n > 1 and not gaps[1:].all():
        raise DeltaError("delta: two changes at one position (corrupt positions)")
    idx = np.cumsum(gaps, dtype=np.int64)
    if idx[-1] >= out.size:
        raise DeltaError(f"delta: a change at element {int(idx[-1])}, the chunk has {out.size}")
    out[idx] ^= _unplanes(body[8 + n * _GAP.itemsize:], out.dtype, n)
