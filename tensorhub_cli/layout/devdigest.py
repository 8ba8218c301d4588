"""dev64: the device-side chunk digest, computed with torch ops where the bytes lie.

Protocol. ``dev64(view)`` takes a flat contiguous uint8 tensor on any device and
returns a 64-bit digest (an int in [0, 2**64)) of its bytes. It runs on the tensor's
own device, in one pass over the bytes, in blocks of ``block_bytes`` (a multiple of
8) so that its temporaries stay bounded (two blocks of int64 lanes, a third where
the view is not 8-byte aligned); only the 8-byte sum
comes back to the host. The digest depends on the bytes alone: not on the device,
the block size, or where the view starts in memory, so a CUDA reader, a host reader
and the publisher agree. ``bench_digest(nbytes)`` measures it (GB/s) for
``scripts/gpu-check``. Host memory keeps XXH3 (``checksum.py``); a manifest names the
digest each chunk carries (``ChunkMeta.digest``).

The arithmetic, exactly (all mod 2**64; ``checksum`` tests hold a numpy copy of it):

- pad the ``n`` bytes with zeros to a multiple of 8 and read them as little-endian
  64-bit lanes ``w[0..L)`` (every CUDA device and every x86/ARM host is little-endian);
- each lane: ``h[i] = fmix64(w[i] + (i + 1) * K1)``, ``fmix64`` being MurmurHash3's
  finalizer (xor-shift 33, ×K2, xor-shift 33, ×K3, xor-shift 33), a bijection;
- ``digest = fmix64(sum(h) + n * K1)``.

What it detects. Any change confined to one 8-byte lane (any single flipped bit, any
burst of up to 8 bytes inside one lane) changes exactly one ``h[i]`` (``fmix64`` and the
position offset are bijections), hence the sum, hence the digest (the final step is a
bijection of the sum for a given length): always, not with some probability. Any other
accidental change (bytes shifted or misplaced to another offset, swapped words,
truncation or zero padding, whose length enters the final step, a stale or foreign
chunk) mixes every affected lane with its position, so it goes unnoticed only when
unrelated 64-bit values happen to sum equal: about 2**-64 for data not built for it.

What it does not claim. It is not cryptographic: with ``K1..K3`` public and a linear
sum, anyone can construct two different chunks with one digest. It guards against
corruption in transit and memory, not against a malicious holder (the cluster token
and the authenticated control plane do that).

Why this shape: int64 multiply, add, shift and sum are what torch runs identically on
CPU and CUDA, and modular addition is associative and commutative, so any reduction
order (CPU threads, CUDA trees, our blocks) gives one sum. Signed int64 stands in for
uint64 (torch's CUDA uint64 support is thin): the bits of two's complement add and
multiply are the unsigned ones, and a logical right shift is an arithmetic one masked.

Cost (H200, torch 2.11, 2026-12-04): 90 GB/s over 1 GiB, 76 GB/s per 16 MiB chunk,
32 MiB of temporaries; the same digests as on CPU for every size and alignment tried.
Each block runs about 14 eager elementwise kernels, each bound by memory bandwidth:
fusing them into one (Triton, ``torch.compile``) is the way to go faster.
"""

from __future__ import annotations

import time

MASK64 = (1 << 64) - 1
K1 = 0x9E3779B97F4A7C15  # position step (2**64 / golden ratio, odd)
K2 = 0xFF51AFD7ED558CCD  # MurmurHash3 fmix64 multipliers (odd: multiplying is a bijection)
K3 = 0xC4CEB9FE1A85EC53
SHIFT = 33
BLOCK_BYTES = 16 << 20


def _signed(k: int) -> int:
    """The int64 with the bits of the uint64 ``k`` (torch has no uint64 arithmetic on CUDA)."""
    return k - (1 << 64) if k >= 1 << 63 else k


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer on a Python int (the host side of the digest)."""
    x ^= x >> SHIFT
    x = (x * K2) & MASK64
    x ^= x >> SHIFT
    x = (x * K3) & MASK64
    return x ^ (x >> SHIFT)


def dev64(view, block_bytes: int = BLOCK_BYTES) -> int:
    import torch

    if not isinstance(view, torch.Tensor) or view.dtype != torch.uint8 or view.dim() != 1 \
            or not view.is_contiguous():
        raise ValueError(f"view: want a flat contiguous uint8 tensor, got "
                         f"{getattr(view, 'dtype', type(view).__name__)} of shape {tuple(getattr(view, 'shape', ()))}")
    if not isinstance(block_bytes, int) or block_bytes <= 0 or block_bytes % 8:
        raise ValueError(f"block_bytes: want a positive multiple of 8, got {block_bytes!r}")
    n = view.numel()
    dev = view.device
    # Lanes can be read in place only where the bytes are 8-byte aligned; otherwise
    # each block is first copied (on the device) into an aligned scratch buffer.
    aligned = view.data_ptr() % 8 == 0 and view.storage_offset() % 8 == 0
    lanes_per_block = min(block_bytes, n + 7) // 8
    x = torch.empty(lanes_per_block, dtype=torch.int64, device=dev)
    t = torch.empty_like(x)
    scratch = None
    acc = torch.zeros((), dtype=torch.int64, device=dev)
    for start in range(0, n, block_bytes):
        block = view[start:start + block_bytes]
        full, rest = divmod(block.numel(), 8)
        k = full + (rest > 0)
        xs, ts = x[:k], t[:k]
        first = start // 8 + 1
        torch.arange(first, first + k, dtype=torch.int64, device=dev, out=xs)
        xs.mul_(_signed(K1))
        if aligned:
            xs[:full].add_(block[:full * 8].view(torch.int64))
        else:
            if scratch is None:
                scratch = torch.empty(lanes_per_block * 8, dtype=torch.uint8, device=dev)
            scratch[:full * 8].copy_(block[:full * 8])
            xs[:full].add_(scratch[:full * 8].view(torch.int64))
        if rest:  # only the view's last lane: its zero padding, 8 bytes on the device
            tail = torch.zeros(8, dtype=torch.uint8, device=dev)
            tail[:rest].copy_(block[full * 8:])
            xs[full:].add_(tail.view(torch.int64))
        _fmix_(xs, ts)
        acc.add_(xs.sum())
    total = acc.item() & MASK64  # the one device→host transfer: 8 bytes
    return fmix64((total + n * K1) & MASK64)


def _fmix_(x, t) -> None:
    """``fmix64`` in place on int64 lanes (``t``: scratch of the same shape)."""
    import torch

    mask = (1 << (64 - SHIFT)) - 1  # arithmetic shift, masked: a logical one
    for k in (K2, K3, None):
        torch.bitwise_right_shift(x, SHIFT, out=t)
        t.bitwise_and_(mask)
        x.bitwise_xor_(t)
        if k is not None:
            x.mul_(_signed(k))


def bench_digest(nbytes: int, device: str | None = None, repeats: int = 3) -> float:
    """GB/s of ``dev64`` over ``nbytes`` random bytes on ``device`` (default: cuda if
    there is one), best of ``repeats`` after one warm-up. For ``scripts/gpu-check``."""
    import torch

    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes: want a positive int, got {nbytes!r}")
    if not isinstance(repeats, int) or repeats <= 0:
        raise ValueError(f"repeats: want a positive int, got {repeats!r}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dev64(data)  # warm-up: allocator, kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dev64(data)  # ends with .item(): the device work is done when it returns
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
