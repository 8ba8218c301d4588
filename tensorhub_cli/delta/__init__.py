"""Deltas: a chunk of v+1 sent as what changed against v, to a reader that holds v.

Protocol. ``codec`` is pure: ``encode(old, new)`` gives a delta or ``None`` (send the
full chunk), ``decode(old, delta)`` the new chunk's bytes, ``rebuild_verified`` decodes
and checks the manifest's digest; every refusal is a ``DeltaError`` naming what is
wrong. A rebuilt chunk counts only once verified against v+1's digest (contract 5).
"""

from .codec import DeltaError, decode, encode, rebuild, rebuild_verified

__all__ = ["DeltaError", "decode", "encode", "rebuild", "rebuild_verified"]
