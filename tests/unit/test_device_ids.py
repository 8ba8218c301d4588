"""Device ids end to end through the NIXL engine, with a fake NIXL agent (no UCX, no
CUDA: the engine only passes ints, so Region.device = 3 needs no real GPU memory).

A holder registers memory on one device, its description carries that device, and a
reader's read gives NIXL both ids: its own device for the local descriptors and the
holder's for the remote ones (NIXL matches remote descriptors by address and id)."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from tensorhub_cli.engines import nixl as nixl_engine
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import EngineError, Pair, Region

from .nixlkit import nixl_pair


class RecordingAgent:
    """Records every descriptor list the engine hands NIXL."""

    def __init__(self, name: str):
        self.name = name
        self.registered: list[tuple[str, list]] = []
        self.xfer_descs: list[tuple[str, list]] = []
        self.loaded: list[bytes] = []

    def register_memory(self, descs, mem_type):
        self.registered.append((mem_type, list(descs)))
        return ("reg", len(self.registered))

    def deregister_memory(self, reg):
        pass

    def get_partial_agent_metadata(self, reg, inc_conn_info):
        return f"md-of-{self.name}".encode()

    def add_remote_agent(self, md):
        self.loaded.append(md)
        return md.decode().removeprefix("md-of-")

    def get_xfer_descs(self, descs, mem_type):
        self.xfer_descs.append((mem_type, list(descs)))
        return descs

    def initialize_xfer(self, op, local, remote, agent):
        return (op, agent)

    def transfer(self, handle):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def release_xfer_handle(self, handle):
        pass


@pytest.fixture
def make_engine(monkeypatch):
    agents: dict[str, RecordingAgent] = {}

    def nixl_agent(name, config):
        agents[name.split(".")[0]] = RecordingAgent(name.split(".")[0])
        return agents[name.split(".")[0]]

    fake = SimpleNamespace(nixl_agent=nixl_agent, nixl_agent_config=lambda **kw: None)
    monkeypatch.setattr(nixl_engine, "load_nixl", lambda *a, **kw: fake)
    monkeypatch.setenv("TH_NIXL_PROGRESS_THREAD", "0")  # (a fake agent: no binding to give a thread delay)

    def make(name: str):
        return nixl_engine.NixlEngine(name), agents[name]
    return make


HOLDER_ADDR, READER_ADDR, N = 0x7F0000100000, 0x7F0000900000, 4096


def holder_and_peer(make_engine, holder_device: int):
    holder, holder_agent = make_engine("holder")
    handle = holder.register([Region(HOLDER_ADDR, N, holder_device)])
    reader, reader_agent = make_engine("reader")
    peer = reader.add_peer("127.0.0.1:1", holder.describe(handle))
    return holder_agent, reader, reader_agent, peer


@pytest.mark.parametrize("holder_device,reader_device", [(3, 1), (3, -1), (-1, 1), (-1, -1), (0, 7)])
def test_a_read_names_the_readers_device_locally_and_the_holders_remotely(make_engine, holder_device,
                                                                          reader_device):
    holder_agent, reader, reader_agent, peer = holder_and_peer(make_engine, holder_device)
    holder_mem, holder_id = ("VRAM", holder_device) if holder_device >= 0 else ("DRAM", 0)
    reader_mem, reader_id = ("VRAM", reader_device) if reader_device >= 0 else ("DRAM", 0)
    assert holder_agent.registered == [(holder_mem, [(HOLDER_ADDR, N, holder_id, "")])]

    reader.read(peer, [Pair(HOLDER_ADDR, READER_ADDR, N)], reader_device)

    local, remote = reader_agent.xfer_descs
    assert local == (reader_mem, [(READER_ADDR, N, reader_id)])
    assert remote == (holder_mem, [(HOLDER_ADDR, N, holder_id)])


def test_a_read_that_names_the_holders_device_must_agree_with_its_description(make_engine):
    _, reader, reader_agent, peer = holder_and_peer(make_engine, 3)
    with pytest.raises(EngineError, match="as cuda:2, but holder described cuda:3"):
        reader.read(peer, [Pair(HOLDER_ADDR, READER_ADDR, N)], 1, remote_device=2)
    with pytest.raises(EngineError, match="as host memory, but holder described cuda:3"):
        reader.read(peer, [Pair(HOLDER_ADDR, READER_ADDR, N)], 1, remote_device=-1)
    assert reader_agent.xfer_descs == []  # refused before NIXL saw anything
    reader.read(peer, [Pair(HOLDER_ADDR, READER_ADDR, N)], 1, remote_device=3)
    assert reader_agent.xfer_descs[1] == ("VRAM", [(HOLDER_ADDR, N, 3)])


def test_the_description_carries_the_device_and_an_older_one_reads_as_device_0(make_engine, monkeypatch):
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "256k")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "512k")
    holder, _ = make_engine("holder")
    mem, md, held = msgspec.msgpack.decode(holder.describe(holder.register([Region(HOLDER_ADDR, N, 5)])))
    assert (mem, md, held) == ("VRAM", b"md-of-holder", {"device": 5, "tcp_tx_seg": 256 << 10})
    reader, reader_agent = make_engine("reader")
    older = [msgspec.msgpack.encode(["VRAM", b"md-of-holder"]), msgspec.msgpack.encode(["VRAM", b"md-of-holder", 0])]
    for description in older:  # (and UCX's default 8 KiB segments, which any receive segment takes)
        peer = reader.add_peer("127.0.0.1:1", description)
        reader.read(peer, [Pair(HOLDER_ADDR, READER_ADDR, N)], 1)
        assert reader_agent.xfer_descs[-1] == ("VRAM", [(HOLDER_ADDR, N, 0)])


def test_a_holder_whose_tcp_segments_exceed_our_receive_segment_is_refused_naming_the_variable(make_engine,
                                                                                                monkeypatch):
    """UCX would write the holder's 256 KiB answers past our 64 KiB buffer (nixl_shim)."""
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "256k")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "512k")
    holder, _ = make_engine("holder")
    description = holder.describe(holder.register([Region(HOLDER_ADDR, N, -1)]))
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "8k")
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64k")
    small, small_agent = make_engine("small")
    with pytest.raises(EngineError, match=r"127\.0\.0\.1:1 sends UCX TCP segments of 262144 bytes, larger than "
                                          r"this process's receive segment of 65536 \(UCX_TCP_RX_SEG_SIZE\)"):
        small.add_peer("127.0.0.1:1", description)
    assert small_agent.loaded == []  # refused before NIXL connected anything
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "256k")  # (as large as its segments: enough)
    big, big_agent = make_engine("big")
    big.add_peer("127.0.0.1:1", description)
    assert big_agent.loaded == [b"md-of-holder"]


@pytest.mark.parametrize("description", [msgspec.msgpack.encode(["VRAM", b"md", -2]),
                                         msgspec.msgpack.encode(["HBM", b"md", 1]), b"\xc1",
                                         msgspec.msgpack.encode(["DRAM", b"md", {"device": "0"}]),
                                         msgspec.msgpack.encode(["DRAM", b"md", {"device": 0, "tcp_tx_seg": -1}]),
                                         msgspec.msgpack.encode(["DRAM", b"md", {"device": 0, "tcp_tx_seg": "8k"}])])
def test_a_bad_description_is_refused_when_loaded(make_engine, description):
    reader, _ = make_engine("reader")
    with pytest.raises(EngineError, match="cannot load NIXL metadata of 127.0.0.1:1"):
        reader.add_peer("127.0.0.1:1", description)


@pytest.mark.parametrize("devices", [(3, 1), (-1, 0)])
def test_one_registration_covers_one_device(make_engine, devices):
    holder, agent = make_engine("holder")
    with pytest.raises(EngineError, match="one registration covers one device"):
        holder.register([Region(HOLDER_ADDR, N, devices[0]), Region(READER_ADDR, N, devices[1])])
    assert agent.registered == []


def test_the_description_round_trip_works_with_real_nixl_on_host_memory():
    """The fake agent above checks ids; this checks the description's format against
    the real NIXL (host memory: the ids are 0, a GPU run checks the rest)."""
    import time

    import torch

    with nixl_pair() as (holder, reader, peer, src, dst):
        assert (peer.mem, peer.device) == ("DRAM", 0)
        xfer = reader.read(peer, [Pair(src.data_ptr(), dst.data_ptr(), src.nbytes)], -1, remote_device=-1)
        deadline = time.monotonic() + 20
        while reader.state(xfer) == "pending" and time.monotonic() < deadline:
            holder.progress()
            reader.progress()
            time.sleep(0.001)
        assert reader.state(xfer) == "done", "the NIXL READ did not finish within 20 s"
        assert reader.release(xfer) and torch.equal(dst, src)

def test_the_peer_wire_carries_the_holders_device():
    sent = wire.Answer(body=wire.Described(engine="nixl", description=b"d", rank=0, addrs=[HOLDER_ADDR], device=3))
    frame = wire.frame(sent)
    got = msgspec.msgpack.Decoder(wire.Answer).decode(frame[4:])
    assert got.body.device == 3
    older = msgspec.msgpack.encode({"body": {"type": "described", "engine": "nixl", "description": b"d",
                                             "rank": 0, "addrs": []}})
    assert msgspec.msgpack.Decoder(wire.Answer).decode(older).body.device == -1  # host, as before


# --- the tier an endpoint registers with follows its device (connect) ---------------

@pytest.fixture
def registered(monkeypatch):
    """What connect would register, without a hub: the EndpointInfo it builds."""
    import tensorhub_cli.endpoint as endpoint_pkg

    def fake_endpoint(hub, token, info, **kw):
        return info
    monkeypatch.setattr(endpoint_pkg, "Endpoint", fake_endpoint)
    return lambda **kw: endpoint_pkg.connect("tcp://127.0.0.1:1", "tok", name="ep", **kw)


@pytest.mark.parametrize("kw,tier", [
    ({}, "host"), ({"device": "cpu"}, "host"), ({"device": "cuda:1"}, "device"), ({"device": 3}, "device"),
    ({"tier": "device"}, "device"), ({"tier": "device", "device": "cuda:0"}, "device"),
    ({"tier": "host", "device": "cpu"}, "host"),
])
def test_the_tier_follows_the_device(registered, kw, tier):
    assert registered(**kw).tier == tier


def test_a_torch_device_names_the_device(registered):
    import torch

    assert registered(device=torch.device("cuda", 2)).tier == "device"
    assert registered(device=torch.device("cpu")).tier == "host"


@pytest.mark.parametrize("kw,words", [
    ({"tier": "host", "device": "cuda:1"}, "tier='host' contradicts device='cuda:1'"),
    ({"tier": "device", "device": "cpu"}, "tier='device' contradicts device='host memory'"),
    ({"device": "gpu0"}, "device takes 'cpu', 'cuda', 'cuda:N'"),
    ({"device": -1}, "device takes a CUDA device index >= 0"),
    ({"device": True}, "device takes"),
    ({"tier": "vram"}, "tier takes one of 'device', 'host'"),
])
def test_a_tier_or_device_that_cannot_be_is_a_bad_argument(registered, kw, words):
    from tensorhub_cli.errors import BadArgument

    with pytest.raises(BadArgument, match=words.replace("(", r"\(").replace(")", r"\)")):
        registered(**kw)
