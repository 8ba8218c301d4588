"""Two real NIXL engines on host memory, one holding a random buffer the other may read:
what tests of the real agent (not the fake one) need. Skips the test where NIXL does
not load."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tensorhub_cli.engines.base import Region


@contextmanager
def nixl_pair(nbytes: int = 1 << 16):
    """Yield (holder, reader, peer, src, dst): ``src`` registered at the holder, ``dst``
    at the reader, ``peer`` the holder as the reader's peer. Deregistered and closed after."""
    from tensorhub_cli.engines import nixl as nixl_engine
    from tensorhub_cli.engines.nixl_shim import NixlUnavailable

    try:
        holder, reader = nixl_engine.NixlEngine("holder"), nixl_engine.NixlEngine("reader")
    except NixlUnavailable as exc:
        pytest.skip(f"NIXL does not load here: {exc}")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    handles = [(holder, holder.register([Region(src.data_ptr(), src.nbytes)])),
               (reader, reader.register([Region(dst.data_ptr(), dst.nbytes)]))]
    try:
        yield holder, reader, reader.add_peer("127.0.0.1:1", holder.describe(handles[0][1])), src, dst
    finally:
        for engine, handle in handles:
            engine.deregister(handle)
            engine.close()
