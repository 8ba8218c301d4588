"""Chunk checksums: the XXH3-64 digest each ``ChunkMeta`` carries (contract 5).

Protocol. ``checksum(view)`` takes a flat uint8 tensor and returns XXH3-64 of its
bytes as an int; device memory is hashed from a host copy. It may be called from any
thread, on memory nobody writes meanwhile.

Why python-xxhash's hasher object and not ``xxh3_64_intdigest``: the one-shot
function holds the GIL for the whole hash, while the object's ``update`` releases it
(every 3.x release; 4.x above 64 KiB). The endpoint hashes fetched chunks on verifier
threads so that hashing overlaps the fetch loop; holding the GIL would serialize them.
XXH3's streaming and one-shot forms give the same digest, so manifests do not change.
"""

from __future__ import annotations

import xxhash


def checksum(view) -> int:
    host = view if view.device.type == "cpu" else view.cpu()
    return xxhash.xxh3_64(host.numpy()).intdigest()
