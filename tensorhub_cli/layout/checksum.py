"""Chunk checksums: the digest each ``ChunkMeta`` carries, of the kind it names (contract 5).

Protocol. ``digest(view, kind)`` takes a flat uint8 tensor and returns the digest of
its bytes that ``ChunkMeta.digest`` names, as an int: ``"xxh3"`` (host memory) is
``checksum(view)``, XXH3-64, hashed from a host copy when the view is device memory;
``"dev64"`` (device memory) is ``devdigest.dev64``, torch ops on the view's own device,
no host copy. ``digest_for(device)`` is the kind a publisher on that device uses
(-1: host). Either may be called from any thread, on memory nobody writes meanwhile.

Why python-xxhash's hasher object and not ``xxh3_64_intdigest``: the one-shot
function holds the GIL for the whole hash, while the object's ``update`` releases it
(every 3.x release; 4.x above 64 KiB). The endpoint hashes fetched chunks on verifier
threads so that hashing overlaps the fetch loop; holding the GIL would serialize them.
XXH3's streaming and one-shot forms give the same digest, so manifests do not change.
"""

from __future__ import annotations

import xxhash

from .devdigest import dev64

DIGESTS = ("xxh3", "dev64")


def checksum(view) -> int:
    host = view if view.device.type == "cpu" else view.cpu()
    return xxhash.xxh3_64(host.numpy()).intdigest()


def digest(view, kind: str) -> int:
    if kind == "xxh3":
        return checksum(view)
    if kind == "dev64":
        return dev64(view)
    raise ValueError(f"kind: {kind!r} is not a digest (one of {', '.join(DIGESTS)})")


def digest_for(device: int) -> str:
    """Device memory is hashed where it lies (dev64); host memory with XXH3, the faster there."""
    return "xxh3" if device < 0 else "dev64"
