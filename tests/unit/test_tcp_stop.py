"""Giving up a tcp read ends it at once, wherever it blocks, even in its connect: a
holder whose link went down answers no SYN, and the read is stopped when the hub
re-plans it, not at the engine's timeout. A listener whose accept queue is full drops
SYNs the same way."""

from __future__ import annotations

import socket
import time

import torch

from tensorhub_cli.engines.base import Pair
from tensorhub_cli.engines.tcp import TcpEngine

TIMEOUT_S = 30.0


def _silent_holder() -> tuple[socket.socket, list[socket.socket], str]:
    """A listener that never accepts, its one-slot queue filled: a connect to it hangs."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    host, port = listener.getsockname()
    filler = socket.create_connection((host, port), timeout=2)
    return listener, [filler], f"{host}:{port}"


def _connecting(xfer, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if xfer.sock is not None:
            return True
        time.sleep(0.01)
    return False


def test_a_read_stopped_while_it_connects_ends_at_once_not_at_the_timeout():
    listener, held, address = _silent_holder()
    engine = TcpEngine("t", timeout=TIMEOUT_S)
    dst = torch.zeros(64, dtype=torch.uint8)
    try:
        xfer = engine.read(address, [Pair(0, dst.data_ptr(), dst.nbytes)])
        assert _connecting(xfer), "the read never claimed its socket"
        time.sleep(0.2)
        assert engine.state(xfer) == "pending"  # (its connect hangs: nobody answers the SYN)
        t0 = time.monotonic()
        released = engine.release(xfer)
        deadline = time.monotonic() + 5
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
            released = engine.release(xfer)
        assert released and time.monotonic() - t0 < 5, "the stop waited for the connect's timeout"
        assert engine.state(xfer) == "failed"
        assert torch.count_nonzero(dst) == 0
    finally:
        engine.close()
        for s in (*held, listener):
            s.close()

