"""``engines.nixl_progress``: who drives UCX progress. The policy (``wanted``) without
NIXL; then, with the real NIXL in a child process over UCX's TCP transport (where a
READ needs the holder's worker progressed): a holder nobody calls ``progress`` on serves
a READ with the thread and not without it, and the thread sleeps while idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tensorhub_cli.engines import nixl_progress


def test_the_thread_runs_only_when_asked_and_a_bad_value_is_named():
    assert nixl_progress.wanted({"TH_NIXL_PROGRESS_THREAD": "1"}) is True
    assert nixl_progress.wanted({"TH_NIXL_PROGRESS_THREAD": "0"}) is False
    assert nixl_progress.wanted({}) is False
    assert nixl_progress.wanted({"TH_NIXL_PROGRESS_THREAD": " "}) is False
    with pytest.raises(ValueError, match="TH_NIXL_PROGRESS_THREAD: want 0 or 1, got 'yes'"):
        nixl_progress.wanted({"TH_NIXL_PROGRESS_THREAD": "yes"})


def test_a_wrapper_whose_thread_delay_cannot_be_set_gets_no_thread_rather_than_a_spinning_one(caplog):
    """(Another wrapper's thread would run with its own delay, 0 in NIXL's: a core each.)"""
    configs = []
    fake = SimpleNamespace(__name__="fake._api", nixl_agent=lambda name, config: ("agent", name, config),
                           nixl_agent_config=lambda **kw: configs.append(kw) or kw)
    agent, thread = nixl_progress.make_agent(fake, "a", True)
    assert thread is False and agent[0] == "agent" and configs == [{"enable_prog_thread": False, "backends": ["UCX"]}]
    assert "offers no progress-thread delay" in caplog.text


CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    from tensorhub_cli.engines.base import Pair, Region
    from tensorhub_cli.engines.nixl import NixlEngine
    from tensorhub_cli.engines.nixl_shim import NixlUnavailable
    try:
        holder, reader = NixlEngine("holder"), NixlEngine("reader")
    except NixlUnavailable as exc:
        print(json.dumps({"skip": str(exc)})); sys.exit(0)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    h = holder.register([Region(src.data_ptr(), src.nbytes)])
    reader.register([Region(dst.data_ptr(), dst.nbytes)])
    peer = reader.add_peer("127.0.0.1:1", holder.describe(h))
    xfer = reader.read(peer, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)])
    deadline = time.monotonic() + 3.0
    while reader.state(xfer) == "pending" and time.monotonic() < deadline:
        time.sleep(0.01)  # (the holder's progress is never called here)
    unaided = reader.state(xfer)
    while reader.state(xfer) == "pending":  # (finish it the service thread's way, to exit cleanly)
        holder.progress()
        time.sleep(0.001)
    ok = reader.release(xfer) and torch.equal(dst, src)
    cpu0, t0 = time.process_time(), time.monotonic()
    time.sleep(1.0)
    idle = (time.process_time() - cpu0) / (time.monotonic() - t0)
    print(json.dumps({"unaided": unaided, "equal": ok, "idle_cores": idle,
                      "needs_progress": holder.needs_progress, "ceiling": reader._watcher()._max_s}))
    holder.close(); reader.close()
""")


def _child(thread: str) -> dict:
    env = {**os.environ, "TH_NIXL_PROGRESS_THREAD": thread, "UCX_TLS": "tcp"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"NIXL does not load here: {got['skip']}")
    return got


def test_with_the_thread_a_holder_serves_reads_unaided_and_sleeps_while_idle():
    got = _child("1")
    assert got["unaided"] == "done" and got["equal"], got
    assert got["needs_progress"] is False
    assert got["ceiling"] == nixl_progress.WATCH_CEILING_S  # (its checks only notice ends: fewer of them)
    # The wrapper's own default (a 0 poll timeout) spins a full core here.
    assert got["idle_cores"] < 0.2, f"the idle progress thread spins: {got['idle_cores']:.2f} of a core"


def test_without_the_thread_the_holder_needs_its_watchers_paced_progress():
    """The contrast that makes the test above mean something: over UCX's TCP transport a
    holder's worker must be progressed, or a READ of it never ends."""
    got = _child("0")
    assert got["unaided"] == "pending" and got["equal"], got
    assert got["needs_progress"] is True
    assert got["ceiling"] == 1e-3  # (its checks drive our READs' progress too)
