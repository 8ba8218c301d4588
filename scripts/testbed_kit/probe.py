"""One check transfer over the testbed's links: plain TCP, stdlib only, run inside a
node's namespace by ``up``.

``probe.py recv ADDR PORT`` accepts one stream and prints JSON ``{bytes, first, last}``
(CLOCK_MONOTONIC, which all namespaces share). ``probe.py send ADDR PORT NBYTES`` sends
that many bytes. Both give up after 60 s.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def recv(addr: str, port: int) -> None:
    with socket.create_server((addr, port)) as server:
        server.settimeout(60)
        print("listening", flush=True)
        conn, _ = server.accept()
        conn.settimeout(60)
        buf = bytearray(1 << 20)
        got, first = 0, None
        with conn:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    break
                first = first or time.monotonic()
                got += n
        print(json.dumps({"bytes": got, "first": first, "last": time.monotonic()}), flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    block = b"\0" * (1 << 20)
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=60)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock:
        left = nbytes
        while left > 0:
            sock.sendall(block[: min(left, len(block))])
            left -= len(block)


if __name__ == "__main__":
    mode, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "recv":
        recv(addr, port)
    else:
        send(addr, port, int(sys.argv[4]))
