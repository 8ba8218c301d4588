"""Shared fixtures: free ports, a private TH_HOME and agent store, and a spec for a local cluster."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def agent_store(monkeypatch):
    """Agents a test starts keep their copies (``agent.store``) in a directory of the
    test's own, still on tmpfs where there is one, never in the shared default; it goes
    with the test, whatever the agents left."""
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="th-test-store-", dir=shm if shm.is_dir() else None))
    monkeypatch.setenv("TH_AGENT_STORE", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def th_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "th_home"
    monkeypatch.setenv("TH_HOME", str(home))
    return home


@pytest.fixture
def local_spec(tmp_path) -> Path:
    """specs/local.yaml on addresses and ports no other test or demo uses."""
    doc = yaml.safe_load((REPO / "specs" / "local.yaml").read_text())
    base = 100 + (free_port() % 100)
    doc["name"] = f"t{free_port()}"
    doc["hub"]["port"] = port = free_port()
    # (two calls may return the same free port: the spec rightly refuses equal ports)
    doc["hub"]["metrics_port"] = next(p for p in iter(free_port, None) if p != port)
    doc["hub"]["heartbeat_s"] = 0.2
    doc["hub"]["expiry_s"] = 1.0
    for i, node in enumerate(doc["topology"]["datacenters"][0]["racks"][0]["nodes"]):
        node["address"] = f"127.0.{base}.{i + 1}"
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
