"""Flat layouts: a state_dict ⇄ a manifest's chunks ⇄ addresses in our memory.

Protocol. ``lay_out`` (publisher, ``chunking``) cuts a state_dict into a ``Manifest``
and a ``Placed``; ``place`` (reader, ``placement``) maps any manifest onto a
destination state_dict and returns a ``Placed``; ``verify`` re-hashes a destination
against its manifest; ``checksum`` is the one digest manifests carry. A ``Placed``
keeps every tensor it points into alive: its addresses stay valid while it does.

One concept per module, split where it will grow: ``tensors`` (what memory a tensor
is, ``LayoutError``), ``checksum`` (the digest), ``placed`` (the result records),
``chunking`` (manifest building), ``placement`` (destinations, verification).
"""

from .checksum import checksum
from .chunking import CHUNK_BYTES, SMALL_BYTES, lay_out
from .placed import Piece, Placed
from .placement import allocate, check_destination, place, verify
from .tensors import LayoutError, dtype_name

__all__ = ["CHUNK_BYTES", "SMALL_BYTES", "LayoutError", "Piece", "Placed", "allocate", "check_destination",
           "checksum", "dtype_name", "lay_out", "place", "verify"]
