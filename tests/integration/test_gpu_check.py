"""scripts/gpu-check on host memory (`--cpu`): every section a GPU machine runs, with
real processes, so the script stays working between the rare runs on a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ..conftest import REPO

pytestmark = pytest.mark.integration
SCRIPT = REPO / "scripts" / "gpu-check"


@pytest.mark.timeout(400)
def test_every_section_runs_and_checks_every_byte_on_host_memory(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--gib", "0.01", "--big-gib", "0.045", "--timeout",
                           "60", "--json-out", str(out)], capture_output=True, text=True, timeout=380, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["wrong"] == 0 and doc["errors"] == 0
    sections = {"env", "d2d_copy", "digest", "nixl_vram", "tcp_vram", "h2d_fetch", "collective", "big_fetch"}
    assert sections <= set(doc)
    for name in ("nixl_vram", "tcp_vram", "h2d_fetch", "big_fetch"):
        assert doc[name]["wrong"] == 0 and doc[name]["bytes"] > 0, doc[name]
    assert doc["big_fetch"]["stats"]["reads"] == 40  # 40 tensors of 1.15 MiB: above small_bytes, a chunk each
    members = doc["collective"]["members"]
    assert [m["collective"] for m in members] == ["stripes", "stripes"]
    assert sum(m["bytes"] for m in members) == members[0]["bytes_total"]  # one copy read between the two


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run")
def test_without_a_gpu_it_says_so_and_exits_2():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert "no CUDA device here" in json.loads(proc.stdout)["error"]
