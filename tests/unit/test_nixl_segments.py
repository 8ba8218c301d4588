"""UCX's TCP segments (``nixl_shim.TCP_SEGMENTS``) across processes that disagree on
them, a holder and a reader in two processes over UCX's TCP transport, one with our
segments and one with UCX's defaults (8 KiB out, 64 KiB in, set explicitly). A holder
with UCX's defaults is read by ours, 8 MiB bit for bit. Our holder's 256 KiB answers
would overrun a 64 KiB receive segment (before the check, such a reader got its bytes
and then died with SIGSEGV at exit), so that reader refuses the holder's description,
naming the variable, and exits cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tensorhub_cli.engines.nixl_shim import TCP_SEGMENTS

UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"}
NBYTES = 8 << 20

HOLDER = textwrap.dedent("""
    import base64, json, sys, zlib
    import torch
    from tensorhub_cli.engines.base import Region
    from tensorhub_cli.engines.nixl import NixlEngine
    from tensorhub_cli.engines.nixl_shim import NixlUnavailable
    try:
        engine = NixlEngine("holder")
    except NixlUnavailable as exc:
        print(json.dumps({"skip": str(exc)}), flush=True); sys.exit(0)
    src = torch.randint(0, 256, (int(sys.argv[1]),), dtype=torch.uint8)
    handle = engine.register([Region(src.data_ptr(), src.nbytes)])
    engine.pace(1e-3)  # (over TCP a READ needs the holder's worker progressed)
    print(json.dumps({"description": base64.b64encode(engine.describe(handle)).decode(),
                      "addr": src.data_ptr(), "crc32": zlib.crc32(src.numpy().tobytes())}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    engine.deregister(handle); engine.close()
""")

READER = textwrap.dedent("""
    import base64, json, sys, threading, zlib
    import torch
    from tensorhub_cli.engines.base import EngineError, Pair, Region
    from tensorhub_cli.engines.nixl import NixlEngine
    held = json.loads(sys.stdin.readline())
    engine = NixlEngine("reader")
    dst = torch.zeros(int(sys.argv[1]), dtype=torch.uint8)
    handle = engine.register([Region(dst.data_ptr(), dst.nbytes)])
    try:
        peer = engine.add_peer("holder", base64.b64decode(held["description"]))
    except EngineError as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        engine.deregister(handle); engine.close(); sys.exit(0)
    over, states = threading.Event(), []
    xfer = engine.read(peer, [Pair(held["addr"], dst.data_ptr(), dst.nbytes)])
    engine.when_over(xfer, lambda state: (states.append(state), over.set()))
    over.wait(30)
    released = engine.release(xfer)
    print(json.dumps({"states": states, "released": released,
                      "equal": zlib.crc32(dst.numpy().tobytes()) == held["crc32"]}), flush=True)
    engine.deregister(handle); engine.close()
""")


def _env(segments: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "UCX_TLS": "tcp", "TH_NIXL_PROGRESS_THREAD": "0", **segments}


def _read(holder: dict[str, str], reader: dict[str, str]) -> dict:
    """What the reader process printed, once it exited cleanly."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(NBYTES)], env=_env(holder), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        assert line, f"the holder said nothing: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}"
        if "skip" in json.loads(line):
            pytest.skip(f"NIXL does not load here: {json.loads(line)['skip']}")
        out = subprocess.run([sys.executable, "-c", READER, str(NBYTES)], env=_env(reader), input=line,
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0, f"the reader exited {out.returncode}: {out.stderr[-2000:]}"
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_a_holder_with_ucxs_default_segments_is_read_bit_for_bit_by_ours():
    assert _read(UCX_DEFAULTS, TCP_SEGMENTS) == {"states": ["done"], "released": True, "equal": True}


def test_a_reader_whose_receive_segment_is_smaller_than_our_holders_refuses_it_and_exits_cleanly():
    got = _read(TCP_SEGMENTS, UCX_DEFAULTS)
    assert "refused" in got, got
    assert "segments of 262144 bytes" in got["refused"] and "UCX_TCP_RX_SEG_SIZE" in got["refused"]
