"""Flat layouts: a state_dict ⇄ a manifest's chunks ⇄ addresses in our memory.

Protocol. ``lay_out`` (publisher, ``chunking``) cuts a state_dict into a ``Manifest``
and a ``Placed``; ``place`` (reader, ``placement``) maps any manifest onto a
destination state_dict and returns a ``Placed``; ``verify`` re-hashes a destination
against its manifest; ``digest(view, kind)`` computes the digest a chunk's manifest
names (``checksum``, XXH3, for host memory; ``dev64``, torch ops, on a device). A
``Placed`` keeps every tensor it points into alive: its addresses stay valid while it
does.

One concept per module, split where it will grow: ``tensors`` (what memory a tensor
is, ``LayoutError``), ``checksum`` (the digests, by kind), ``devdigest`` (dev64),
``placed`` (the result records), ``chunking`` (manifest building), ``placement``
(destinations, verification).
"""

from .checksum import DIGESTS, checksum, digest, digest_for
from .chunking import CHUNK_BYTES, SMALL_BYTES, lay_out
from .placed import Piece, Placed
from .placement import allocate, check_destination, place, verify
from .tensors import LayoutError, dtype_name

__all__ = ["CHUNK_BYTES", "DIGESTS", "SMALL_BYTES", "LayoutError", "Piece", "Placed", "allocate",
           "check_destination", "checksum", "digest", "digest_for", "dtype_name", "lay_out", "place", "verify"]
