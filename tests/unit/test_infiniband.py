"""The UCX environment NIXL starts with (engines.nixl_shim), against a fake
/sys/class/infiniband tree: InfiniBand stays on wherever a device exists, ``^ib`` only
where none does, a user's UCX variables always win, and a node's per-GPU NIC list gives
each process its GPU's NIC; UCX's TCP segments are ours unless the user set them. Also
the spec field's way to the processes (launch)."""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import pytest

from tensorhub_cli.engines import nixl_shim
from tensorhub_cli.engines.nixl_shim import TCP_SEGMENTS, ib_devices, net_devices_for, process_gpu, ucx_environment
from tensorhub_cli.launch.cluster import agent_args
from tensorhub_cli.launch.launchers import ucx_net_devices_args
from tensorhub_cli.launch.scale import Operator
from tensorhub_cli.spec import ClusterSpec


@pytest.fixture
def no_ib(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


@pytest.fixture
def with_ib(tmp_path):
    root = tmp_path / "infiniband"
    for dev in ("mlx5_1", "mlx5_0"):
        (root / dev / "ports" / "1").mkdir(parents=True)
    return root


def test_ib_devices_are_listed_from_the_tree(tmp_path, no_ib, with_ib):
    assert ib_devices(with_ib) == ["mlx5_0", "mlx5_1"]
    assert ib_devices(no_ib) == []
    assert ib_devices(tmp_path / "absent") == []  # a kernel without the IB class


def test_ib_is_switched_off_only_where_no_device_exists(no_ib, with_ib, tmp_path):
    assert ucx_environment({}, ib_root=no_ib) == {"UCX_MODULES": "^ib", **TCP_SEGMENTS}
    assert ucx_environment({}, ib_root=tmp_path / "absent") == {"UCX_MODULES": "^ib", **TCP_SEGMENTS}
    assert ucx_environment({}, ib_root=with_ib) == TCP_SEGMENTS


@pytest.mark.parametrize("users", [{"UCX_TCP_TX_SEG_SIZE": "1m"}, {"UCX_TCP_RX_SEG_SIZE": "64k"},
                                   {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "8k"}])
def test_ucx_tcp_segments_are_ours_only_where_the_user_set_neither(no_ib, users):
    """(Ours beside one of the user's could make UCX's receive segment the smaller, which
    it refuses: a user's 1m send segment beside our 512k receive one.)"""
    assert set(TCP_SEGMENTS) == {"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"}
    assert not set(TCP_SEGMENTS) & set(ucx_environment(users, ib_root=no_ib))


@pytest.mark.parametrize("environ,want", [
    ({}, (8 << 10, 64 << 10)),  # UCX's own
    (TCP_SEGMENTS, (256 << 10, 512 << 10)),
    ({"UCX_TCP_TX_SEG_SIZE": "16kb", "UCX_TCP_RX_SEG_SIZE": "2M"}, (16 << 10, 2 << 20)),
    ({"UCX_TCP_TX_SEG_SIZE": "65536", "UCX_TCP_RX_SEG_SIZE": "inf"}, (65536, None)),  # (None: not ours to read)
])
def test_the_tcp_segments_ucx_uses_are_read_as_ucx_reads_them(environ, want):
    assert nixl_shim.tcp_segments(environ) == want


@pytest.mark.parametrize("tree", ["no_ib", "with_ib"])
def test_a_users_ucx_modules_is_never_overridden(request, tree):
    root = request.getfixturevalue(tree)
    assert "UCX_MODULES" not in ucx_environment({"UCX_MODULES": ""}, ib_root=root)
    assert "UCX_MODULES" not in ucx_environment({"UCX_MODULES": "ib,cuda"}, ib_root=root)


PER_GPU = "mlx5_0:1;mlx5_1:1;mlx5_2:1;mlx5_3:1"


@pytest.mark.parametrize("environ,device,want", [
    ({}, 2, 2),  # the device the endpoint named, no remapping
    ({"CUDA_VISIBLE_DEVICES": "3,1"}, 1, 1),  # the process's cuda:1 is physical GPU 1
    ({"CUDA_VISIBLE_DEVICES": "3,1"}, 0, 3),
    ({"CUDA_VISIBLE_DEVICES": "2"}, None, 2),  # the only GPU it sees
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, None, None),  # which of the two: unknown
    ({}, None, None),
    ({"CUDA_VISIBLE_DEVICES": "GPU-8f2e"}, 0, None),  # UUIDs: not an index
])
def test_the_processs_gpu(environ, device, want):
    assert process_gpu(device, environ) == want


@pytest.mark.parametrize("spec,gpu,want", [
    ("mlx5_0:1", 3, "mlx5_0:1"),  # one list for the whole node
    ("mlx5_0:1,mlx5_1:1", None, "mlx5_0:1,mlx5_1:1"),
    (PER_GPU, 2, "mlx5_2:1"),  # one NIC per GPU: its own
    (PER_GPU, None, "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"),  # GPU unknown: all, UCX picks
    ("mlx5_0:1;mlx5_0:1;mlx5_1:1", 9, "mlx5_0:1,mlx5_1:1"),
])
def test_net_devices_for_a_gpu(spec, gpu, want):
    assert net_devices_for(spec, gpu) == want


def test_the_nodes_net_devices_go_to_the_processs_gpu_unless_the_user_set_them(with_ib):
    environ = {"TH_UCX_NET_DEVICES": PER_GPU, "CUDA_VISIBLE_DEVICES": "1"}
    assert ucx_environment(environ, ib_root=with_ib) == {"UCX_NET_DEVICES": "mlx5_1:1", **TCP_SEGMENTS}
    assert ucx_environment(environ, ib_root=with_ib, device=0) == {"UCX_NET_DEVICES": "mlx5_1:1", **TCP_SEGMENTS}
    assert ucx_environment({**environ, "UCX_NET_DEVICES": "mlx5_3:1"}, ib_root=with_ib) == TCP_SEGMENTS
    assert ucx_environment({}, ib_root=with_ib) == TCP_SEGMENTS  # a node without the field


@pytest.fixture
def fake_nixl(monkeypatch, tmp_path):
    """A NIXL API module load_nixl finds by TH_NIXL_MODULE, and a clean UCX environment."""
    api = ModuleType("fakenixl._api")
    api.nixl_agent = object
    monkeypatch.setitem(sys.modules, "fakenixl", ModuleType("fakenixl"))
    monkeypatch.setitem(sys.modules, "fakenixl._api", api)
    monkeypatch.setenv("TH_NIXL_MODULE", "fakenixl")
    for var in ("UCX_MODULES", "UCX_NET_DEVICES", "TH_UCX_NET_DEVICES", "CUDA_VISIBLE_DEVICES", *TCP_SEGMENTS):
        monkeypatch.setenv(var, "")  # (recorded first, so whatever load_nixl sets is undone after the test)
        monkeypatch.delenv(var)
    return api


def test_load_nixl_sets_the_environment_before_nixl_starts(monkeypatch, fake_nixl, no_ib, with_ib):
    monkeypatch.setattr(nixl_shim, "IB_SYSFS", no_ib)
    nixl_shim.use_net_devices(PER_GPU)
    assert nixl_shim.load_nixl(device=3) is fake_nixl
    assert (os.environ["UCX_MODULES"], os.environ["UCX_NET_DEVICES"]) == ("^ib", "mlx5_3:1")
    monkeypatch.delenv("UCX_MODULES")
    monkeypatch.delenv("UCX_NET_DEVICES")
    monkeypatch.setattr(nixl_shim, "IB_SYSFS", with_ib)
    nixl_shim.load_nixl()
    assert "UCX_MODULES" not in os.environ
    assert os.environ["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"


def test_load_nixl_keeps_what_the_user_set(monkeypatch, fake_nixl, no_ib):
    monkeypatch.setattr(nixl_shim, "IB_SYSFS", no_ib)
    monkeypatch.setenv("UCX_MODULES", "")
    monkeypatch.setenv("UCX_NET_DEVICES", "eth0")
    nixl_shim.use_net_devices("mlx5_0:1")
    nixl_shim.load_nixl()
    assert (os.environ["UCX_MODULES"], os.environ["UCX_NET_DEVICES"]) == ("", "eth0")


def spec_with(ucx_net_devices) -> ClusterSpec:
    node = {"name": "n1", "address": "127.0.0.11", "gpus": 2}
    if ucx_net_devices is not None:
        node["ucx_net_devices"] = ucx_net_devices
    return ClusterSpec.model_validate({
        "name": "c", "hub": {"node": "n1"}, "roles": {"rollout": {"count": 1}},
        "topology": {"datacenters": [{"name": "dc", "racks": [{"name": "r", "nodes": [node]}]}]}})


@pytest.mark.parametrize("value,flag", [(None, []), ("mlx5_0:1", ["--ucx-net-devices", "mlx5_0:1"]),
                                        (["mlx5_0:1", "mlx5_1:1"], ["--ucx-net-devices", "mlx5_0:1;mlx5_1:1"])])
def test_agents_and_runners_get_the_nodes_nics_as_a_flag(value, flag):
    spec = spec_with(value)
    node = spec.node("n1")
    assert ucx_net_devices_args(node) == flag
    launcher = SimpleNamespace(token_path=lambda node, token: "/tok")
    state = SimpleNamespace(hub_address="tcp://127.0.0.11:7700")
    args = agent_args(spec, state, launcher, node, "t")
    assert [a for a in args if a.startswith("--ucx")] == flag[:1]
    if flag:
        assert args[args.index(flag[0]) + 1] == flag[1]
    op = Operator.__new__(Operator)  # (no cluster on disk: only what _args reads)
    op.spec, op.state, op.launcher, op.token = spec, state, launcher, "t"
    _, runner = op._args("rollout", node, "rollout-0")
    assert [a for a in runner if a.startswith("--ucx")] == flag[:1]
    if flag:
        assert runner[runner.index(flag[0]) + 1] == flag[1]
