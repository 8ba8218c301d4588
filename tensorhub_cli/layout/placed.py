"""Where a layout's chunks lie in our memory: the record ``lay_out`` and ``place`` return.

Protocol. ``Placed.views[c]`` is chunk ``c``'s bytes in our memory (a flat uint8
tensor; None for a chunk a reader of another layout does not need), ``digests[c]``
the kind of digest its manifest names (``checksum(c)`` computes that one, on the
view's own device for ``dev64``); ``regions`` is what an engine must register to serve
or receive them. ``wanted``: the chunks a reader needs (None: every chunk). A chunk
read in part (``parts[c]``, a reader of another layout: ``overlap``) is read as the
pairs its tiles list and verified tile by tile (``check``). A chunk that spans tensors
of a reader's destination, or lands in a layout other than its own, arrives in a
staging buffer: once it is verified, ``finish(c)`` copies it into those tensors
(before that they are untouched). The memory stays valid while the ``Placed`` (which
keeps every tensor alive) does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engines.base import Region
from .checksum import digest


def follow(view, old, new):
    """``view`` (any dtype, shape, strides) moved from flat uint8 buffer ``old`` onto
    ``new`` (same size), or itself if it does not lie in ``old``."""
    if view is None:
        return None
    off = view.data_ptr() - old.data_ptr()
    if not 0 <= off < old.nbytes:
        return view
    base = new[off:]
    size = view.element_size()
    base = base[:base.nbytes // size * size].view(view.dtype)
    return base.as_strided(tuple(view.shape), tuple(view.stride()), base.storage_offset())


@dataclass(slots=True)
class Piece:
    """One destination tensor's share of a staged chunk."""

    dst: object  # the destination tensor's flat bytes
    offset: int  # where the piece starts in ``dst``
    src: object  # the staged chunk's bytes, from the piece's start
    nbytes: int


@dataclass
class Placed:
    views: list  # per chunk of this layout: a flat uint8 tensor over its bytes in our memory
    regions: list[Region]
    device: int = -1
    scatter: dict[int, list[Piece]] = field(default_factory=dict)
    keep: list = field(default_factory=list)  # tensors the regions point into
    digests: list[str] = field(default_factory=list)  # per chunk: its manifest's ChunkMeta.digest
    wanted: set[int] | None = None  # the chunks a reader needs; None: all
    parts: dict = field(default_factory=dict)  # chunk -> tiles.Tiled: read in part
    waiting: dict[int, list] = field(default_factory=dict)  # chunk -> staged groups it completes
    layout: str = ""  # a reader of another layout: its id (boxes.layout_id of its slots)

    def follow(self, old, new) -> None:
        """Every view into staging buffer ``old`` now points at the same bytes of
        ``new`` (same size): a reused registration's buffer replaces a fresh one
        (``endpoint.registrations``). Views of any dtype and strides follow."""
        self.views[:] = [follow(v, old, new) for v in self.views]
        for pieces in self.scatter.values():
            for piece in pieces:
                piece.src = follow(piece.src, old, new)
        for tiled in self.parts.values():
            tiled.pairs = [(at, follow(v, old, new)) for at, v in tiled.pairs]
            tiled.checks = [(follow(v, old, new), want) for v, want in tiled.checks]
            tiled.copies = [(follow(src, old, new), dst) for src, dst in tiled.copies]
        for groups in self.waiting.values():
            for group in groups:
                group.spans = [(c, lo, n, follow(v, old, new)) for c, lo, n, v in group.spans]
        self.keep[:] = [new if t is old else t for t in self.keep]

    def addr(self, chunk: int) -> int:
        return self.views[chunk].data_ptr()

    def checksum(self, chunk: int) -> int:
        return digest(self.views[chunk], self.digests[chunk])

    def check(self, chunk: int, expected) -> bool:
        """The chunk's bytes (or the tiles of it we read) match ``expected`` (ChunkMeta)."""
        tiled = self.parts.get(chunk)
        if tiled is None:
            return self.checksum(chunk) == expected.checksum
        kind = self.digests[chunk]
        return all(digest(v.contiguous().reshape(-1), kind) == want for v, want in tiled.checks)

    def read_bytes(self, chunk: int) -> int:
        tiled = self.parts.get(chunk)
        return self.views[chunk].nbytes if tiled is None else tiled.nbytes

    def finish(self, chunk: int) -> bool:
        """A verified chunk: copy its bytes into the destination tensors it lands in
        besides its view (staged pieces, tiles, overlapping slots). True when it may have
        queued copies (on a device: async, the caller's stream must wait for them)."""
        copied = chunk in self.scatter or chunk in self.parts or chunk in self.waiting
        for piece in self.scatter.get(chunk, ()):
            piece.dst[piece.offset:piece.offset + piece.nbytes].copy_(piece.src[:piece.nbytes])
        tiled = self.parts.get(chunk)
        if tiled is not None:
            for src, dst in tiled.copies:
                dst.copy_(src)
        for group in self.waiting.pop(chunk, ()):
            group.arrived(chunk)
        return copied
