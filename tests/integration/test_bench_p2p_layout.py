"""`th bench p2p --layout tp2` end to end, tiny: two Shard(0) publisher processes, two TP
reader processes, a real hub, the tcp engine.

Behaviour only: the JSON keys, every fetch checked bit for bit in the readers (the bench
raises otherwise), and the bytes each TP rank read are about its share of the model,
never the whole of it. The times themselves belong in the closing notes.
"""

from __future__ import annotations

import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tensorhub_cli.bench import p2p
from tensorhub_cli.layout.vllm_llama import global_shapes

pytestmark = pytest.mark.integration

CHUNK_MIB = 0.25  # several chunks per big tensor, so column (tile) reads happen


def test_tp2_readers_of_a_shard0_pair_read_their_share_bit_exact():
    r = p2p.run(mib=4, reps=2, chunk_mib=CHUNK_MIB, window=4, engine="tcp", layout="tp2", small_mib=1 / 64)
    assert r["workload"] == "p2p" and r["layout"] == "tp2" and r["engine"] == "tcp" and r["exact"] is True
    model = r["model"]
    assert model["num_hidden_layers"] >= 1 and model["dtype"] == "bfloat16" and model["bytes"] == r["bytes"]
    assert 3 * 2**20 <= model["bytes"] <= 5 * 2**20  # about --mib
    chunk = int(CHUNK_MIB * 2**20)
    for layout in ("tp2", "same"):
        got = r[layout]
        assert set(got) == {"s", "bytes_per_rank", "share_per_rank", "from_publishers_per_rank"}
        assert got["s"] > 0 and len(r["samples_s"][layout]) == 2
        for nbytes, share, pub in zip(got["bytes_per_rank"], got["share_per_rank"], got["from_publishers_per_rank"]):
            assert share <= nbytes <= share * 1.1 + chunk, (layout, got)
            assert nbytes < 0.6 * model["bytes"], (layout, got)  # a rank's half, never the whole model
            assert 0 <= pub <= nbytes
        # a rank's share is half the model (tp2: plus the other half of each norm)
        assert sum(got["share_per_rank"]) >= model["bytes"]
    assert r["tp2"]["share_per_rank"][0] > r["same"]["share_per_rank"][0]  # the norms whole
    assert r["time_ratio"] == r["same"]["s"] / r["tp2"]["s"]
    assert r["bytes_over_share"] == max(b / s for b, s in zip(r["tp2"]["bytes_per_rank"], r["tp2"]["share_per_rank"]))


def test_llama_config_reaches_the_size_asked():
    for mib in (4, 64, 256):
        config = p2p.llama_config(mib)
        nbytes = 2 * sum(math.prod(s) for s in global_shapes(SimpleNamespace(**config)).values())
        assert 0.75 * mib * 2**20 <= nbytes <= 1.25 * mib * 2**20, (mib, config, nbytes)
    with pytest.raises(ValueError, match="mib"):
        p2p.llama_config(0)
    with pytest.raises(ValueError, match="layout"):
        p2p.run(layout="tp4")


def test_cli_refuses_an_unknown_layout_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "p2p", "--layout", "tp4"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--layout must be same or tp2" in proc.stderr
