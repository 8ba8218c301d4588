"""Publisher side: cut a state_dict into a manifest's chunks, where the tensors lie.

Protocol. ``lay_out(state_dict, chunk_bytes, small_bytes, digest=None)`` returns the
``Manifest`` (tensors in the state_dict's order, each chunk's size, checksum and digest
kind) and the ``Placed`` to register. Tensors of at least ``small_bytes`` are chunked
where they lie (never copied), each starting a new chunk so that a chunk never spans
two of them; smaller tensors are copied once into one staging buffer, laid out first
and chunked as a whole. Checksums are taken where the tensors lie: ``digest=None``
picks the kind from their device (``digest_for``: dev64 on a GPU, no host copy; XXH3
on the host); naming a kind forces it (tests hash CPU tensors as dev64). The caller
must not change the big tensors while the manifest is published: their checksums
were taken here. Raises ``LayoutError`` (nothing copied) when a tensor cannot
register or ``digest`` names no kind.
"""

from __future__ import annotations

from ..engines.base import Region
from ..hub import protocol as p
from .checksum import DIGESTS, digest_for
from .checksum import digest as digest_of
from .placed import Placed
from .tensors import LayoutError, check_tensors, dtype_name, flat_bytes

CHUNK_BYTES = 16 << 20
SMALL_BYTES = 1 << 20


def lay_out(state_dict: dict, chunk_bytes: int = CHUNK_BYTES, small_bytes: int = SMALL_BYTES,
            digest: str | None = None) -> tuple[p.Manifest, Placed]:
    import torch

    problems, device = check_tensors(state_dict)
    if not state_dict:
        problems.append("the state_dict is empty")
    if digest is not None and digest not in DIGESTS:
        problems.append(f"digest: {digest!r} is not one of {', '.join(DIGESTS)}")
    if problems:
        raise LayoutError("cannot publish this state_dict", problems)
    small = {n: t for n, t in state_dict.items() if t.nbytes < small_bytes}
    big = {n: t for n, t in state_dict.items() if t.nbytes >= small_bytes}
    metas: dict[str, p.TensorMeta] = {}
    placed = Placed(views=[], regions=[], device=device)
    offset = 0
    if small:
        dev = "cpu" if device < 0 else f"cuda:{device}"
        staging = torch.empty(sum(t.nbytes for t in small.values()), dtype=torch.uint8, device=dev)
        for name, t in small.items():
            staging[offset:offset + t.nbytes].copy_(flat_bytes(t))
            metas[name] = p.TensorMeta(name=name, dtype=dtype_name(t), shape=list(t.shape), nbytes=t.nbytes, offset=offset)
            offset += t.nbytes
        _add_span(placed, staging, offset, chunk_bytes)
    for name, t in big.items():
        metas[name] = p.TensorMeta(name=name, dtype=dtype_name(t), shape=list(t.shape), nbytes=t.nbytes, offset=offset)
        _add_span(placed, t, t.nbytes, chunk_bytes)
        offset += t.nbytes
    kind = digest or digest_for(device)
    placed.digests = [kind] * len(placed.views)
    chunks = [p.ChunkMeta(nbytes=v.nbytes, checksum=digest_of(v, kind), digest=kind) for v in placed.views]
    manifest = p.Manifest(tensors=[metas[n] for n in state_dict], chunks=chunks, chunk_bytes=chunk_bytes)
    return manifest, placed


def _add_span(placed: Placed, t, nbytes: int, chunk_bytes: int) -> None:
    if nbytes == 0:
        return
    flat = flat_bytes(t)
    placed.regions.append(Region(flat.data_ptr(), nbytes, placed.device))
    placed.keep.append(t)
    for start in range(0, nbytes, chunk_bytes):
        placed.views.append(flat[start:start + chunk_bytes])
