"""Layouts: a state_dict ⇄ a manifest's chunks ⇄ addresses in our memory (contract 9).

Protocol. ``lay_out`` (publisher, ``chunking``) cuts a state_dict into a ``Manifest``
and a ``Placed``; ``place`` (reader, ``placement``) maps any manifest onto a
destination state_dict and returns a ``Placed``; ``verify`` re-hashes a destination
against its manifest; ``digest(view, kind)`` computes the digest a chunk's manifest
names (``checksum``, XXH3, for host memory; ``dev64``, torch ops, on a device). A
``Placed`` keeps every tensor it points into alive: its addresses stay valid while it
does.

Across layouts: a publisher's values may be ``Part``s (a box of a global tensor) or
DTensors (``dtensor``); a reader's destination may hold ``Target``s (``whole``,
``tp``, ``fused``; ``vllm_llama`` for the HF → vLLM Llama map) or DTensors, and
``overlap.place_boxes`` plans it by box overlap (``boxes``: the pure geometry).

One concept per module, split where it will grow: ``tensors`` (what memory a tensor
is, ``LayoutError``), ``checksum`` (the digests, by kind), ``devdigest`` (dev64),
``placed`` (the result records), ``chunking`` (manifest building, tiles),
``placement`` (same-layout destinations, verification), ``boxes``, ``targets``,
``dtensor``, ``overlap`` (reading by box overlap), ``tiles`` (reading part of a
chunk), ``vllm_llama``.
"""

from .checksum import DIGESTS, checksum, digest, digest_for
from .chunking import CHUNK_BYTES, SMALL_BYTES, lay_out
from .placed import Piece, Placed
from .placement import allocate, check_destination, place, verify
from .targets import Part, Slot, Target, fused, tp, whole
from .tensors import LayoutError, dtype_name

__all__ = ["CHUNK_BYTES", "DIGESTS", "SMALL_BYTES", "LayoutError", "Part", "Piece", "Placed", "Slot", "Target",
           "allocate", "check_destination", "checksum", "digest", "digest_for", "dtype_name", "fused", "lay_out",
           "place", "tp", "verify", "whole"]
