"""``TcpEngine.close`` stops the reads still pending and waits for them: once it
returns, no read of that engine writes into memory again (contract 3)."""

from __future__ import annotations

import time

import pytest
import torch

from tensorhub_cli.endpoint.peer import PeerServer
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import EngineError, Pair, Region
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.engines.tcp import TcpEngine

TOKEN = "t"


def test_close_stops_and_joins_pending_reads_so_none_writes_after_it_returned(monkeypatch):
    monkeypatch.setenv("TH_TEST_SERVE_BPS", str(1 << 20))  # 4 MiB at 1 MiB/s: still receiving at close
    src = torch.ones(4 << 20, dtype=torch.uint8)
    regions = Regions()
    regions.add(1, [Region(src.data_ptr(), src.nbytes)], owner=src)
    server = PeerServer("127.0.0.1", TOKEN, lambda ask: wire.Refused(code="x", message=""), regions, idle_s=60)
    engine = TcpEngine(TOKEN, timeout=5.0, threads=1)  # one thread: the second read waits in the queue
    running, queued = torch.zeros_like(src), torch.zeros_like(src)
    try:
        xfers = [engine.read(server.address, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
                 for dst in (running, queued)]
        deadline = time.monotonic() + 10
        while not running.count_nonzero() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.count_nonzero(), "the first read never started receiving"
        engine.close(timeout=5)
        assert [engine.state(x) for x in xfers] == ["failed", "failed"]
        written = int(running.count_nonzero())
        assert written < src.nbytes, "the read finished before close: nothing was stopped"
        time.sleep(0.5)
        assert int(running.count_nonzero()) == written, "a read wrote into memory after close returned"
        assert not queued.count_nonzero()
        with pytest.raises(EngineError, match="closed"):
            engine.read(server.address, [Pair(src.data_ptr(), queued.data_ptr(), src.nbytes)])
    finally:
        engine.close(timeout=5)
        server.close(timeout=5)
