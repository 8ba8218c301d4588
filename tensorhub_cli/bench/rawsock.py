"""The raw-socket arm of `th bench fanout --testbed`: what one TCP stream costs in CPU
per byte on the same links, the floor our endpoints' CPU per GiB is judged against.

``python -m tensorhub_cli.bench.rawsock recv --port P --nbytes N`` listens on P, takes
one connection, reads exactly N bytes into one preallocated buffer (``recv_into``:
one kernel copy per byte, nothing in Python per byte) and prints one JSON line:
``cpu_s`` (its own user + system CPU from the first byte to the last), ``seconds``
and ``crc32`` of what arrived (computed after the timing). ``send --address A --port
P --nbytes N --seed S`` fills a buffer with N bytes of ``seed``, connects (retrying
for ``--timeout-s`` while the receiver comes up), sends it with ``sendall`` and prints
the same fields for its side, ``crc32`` of what it sent. The driver compares the two
CRCs: a mismatch fails the row. Every wait is bounded by ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import socket
import sys
import time
import zlib


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def payload(nbytes: int, seed: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(nbytes))


def recv(port: int, nbytes: int, timeout_s: float) -> dict:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(timeout_s)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(timeout_s)
        got = conn.recv_into(view, nbytes)  # (the clock starts with the first byte)
        t0, cpu0 = time.perf_counter(), _cpu()
        while got < nbytes:
            n = conn.recv_into(view[got:], nbytes - got)
            if not n:
                raise ConnectionError(f"the sender closed after {got} of {nbytes} bytes")
            got += n
        seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
    return {"cpu_s": cpu, "seconds": seconds, "nbytes": got, "crc32": zlib.crc32(buf)}


def send(address: str, port: int, nbytes: int, seed: int, timeout_s: float) -> dict:
    buf = payload(nbytes, seed)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((address, port), timeout=timeout_s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # (the receiver is still starting: a bounded wait for it to listen)
    with conn:
        t0, cpu0 = time.perf_counter(), _cpu()
        conn.sendall(buf)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # the receiver closes once it has every byte
        seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
    return {"cpu_s": cpu, "seconds": seconds, "nbytes": nbytes, "crc32": zlib.crc32(buf)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tensorhub_cli.bench.rawsock")
    ap.add_argument("side", choices=["recv", "send"])
    ap.add_argument("--address", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--nbytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    a = ap.parse_args(argv)
    if a.side == "recv":
        out = recv(a.port, a.nbytes, a.timeout_s)
    else:
        out = send(a.address, a.port, a.nbytes, a.seed, a.timeout_s)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
