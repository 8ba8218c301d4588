"""Hostile traffic while a fetch runs: requests with a wrong token, undecodable frames."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import zmq

from ...engines import wire
from ...hub import protocol as p
from ..rig import Driven, RigError
from .rows import Run, fetch_row


def _refused_peer(address: str, body: bytes) -> str:
    """Send one frame to a holder's peer channel → the refusal code it answers."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(len(body).to_bytes(4, "big") + body)
        answer = wire.recv_answer(sock)
    return getattr(answer.body, "code", type(answer.body).__name__)


def _refused_hub(r: Run, frames: list[bytes]) -> str:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(r.hub.address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(5000):
            return "no reply"
        body = p.decode_reply(sock.recv()).body
        return getattr(body, "code", type(body).__name__)
    finally:
        sock.close()


def spam(fault: str, r: Run, source: Driven, reader: Driven, model: str, base_s: float) -> dict:
    peer = source.ask("peer_address")["address"]
    if fault == "bad_token":
        want = "auth"
        hub_frames = [p.encode(p.Request(v=p.PROTOCOL_VERSION, token="x" * 32, rid=1, op=p.Status()))]
        peer_body = msgspec.msgpack.encode(wire.Ask(v=wire.WIRE_VERSION, token="x" * 32,
                                                    op=wire.Describe(model=model, version=1)))
    else:
        want = "malformed"
        hub_frames = [b"\x00garbage\xff"]
        peer_body = b"\x00garbage\xff" * 3
    before = r.counters().get(f"errors.{want}", 0)
    sent: list[tuple[float, str, str]] = []  # (when answered, channel, refusal code)
    stop = threading.Event()

    def spam() -> None:  # alternately the hub and the holder, until the fetch returned
        while not stop.is_set():
            sent.append((time.monotonic(), "hub", _refused_hub(r, hub_frames)))
            sent.append((time.monotonic(), "peer", _refused_peer(peer, peer_body)))

    t_start = time.monotonic()
    r.send_fetch(reader, model, 1)
    thread = threading.Thread(target=spam, daemon=True)
    thread.start()
    try:
        res = reader.recv(r.timeout + 30)
    finally:
        stop.set()
        thread.join(15)
    if thread.is_alive():
        raise RigError(f"{fault}: the refused requests to the hub and {source.name} did not end within 15s")
    counted = r.counters().get(f"errors.{want}", 0) - before
    hub_sent = sum(1 for _, ch, _ in sent if ch == "hub")
    t_done = res.get("t_done", time.monotonic())
    during = {ch: sum(1 for t, c, _ in sent if c == ch and t_start <= t <= t_done) for ch in ("hub", "peer")}
    refused = all(code == want for _, _, code in sent)
    extra = (f"{hub_sent} to the hub and {len(sent) - hub_sent} to {source.name}'s peer channel "
             f"({during['hub']} and {during['peer']} while the fetch ran), all refused {want}: {refused}; "
             f"hub errors.{want} +{counted:.0f}")
    ok = refused and counted == hub_sent and min(during.values()) >= 1
    return fetch_row(fault, res, base_s, 0.0, extra, need=ok)


def rows(r: Run, source: Driven, reader: Driven, faults: list[str]) -> list[dict]:
    """One row per fault of ``faults`` (``bad_token``, ``garbage_frames``), each against
    the same unfaulted fetch of model ``bt`` from ``source``."""
    r.publish(source, "bt", 1)
    base = r.unfaulted(faults[0], reader, "bt", 1)
    out = []
    for i, fault in enumerate(faults):
        if i:
            r.unpublish(reader, "bt", 1)  # the previous row's fetch made the reader a holder
        out.append(spam(fault, r, source, reader, "bt", base["s"]))
    return out
