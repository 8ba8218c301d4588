"""`th bench fanout` on loopback, tiny: ours, star and the gloo broadcast baseline in one
run, real hub, publisher, reader and gloo rank processes, the tcp engine.

Behaviour only: the JSON keys and ratios, warm rows, and that the broadcast's bytes
were checked (every rank's CRC-32 equal to rank 0's, else the run raises; rank 0's equal
to the payload's, rebuilt here from the row's version). Times belong in `th bench`.
"""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest

from tensorhub_cli.bench import fanout
from tensorhub_cli.bench.broadcast import payload

from ..conftest import REPO

pytestmark = pytest.mark.integration

MIB = 4


def test_fanout_rows_carry_ours_star_and_a_verified_broadcast():
    r = fanout.run([1, 2], mib=MIB, chunk_mib=1, window=2, engine="tcp")
    assert r["workload"] == "fanout" and r["engine"] == "tcp" and r["warmup"] is True
    assert r["bytes"] == MIB * 2**20
    assert [row["readers"] for row in r["rows"]] == [1, 2]
    assert [row["version"] for row in r["rows"]] == [2, 3]  # version 1 was the warm-up
    for row in r["rows"]:
        assert {"ours_s", "star_s", "broadcast_s", "star_vs_ours", "broadcast_vs_ours", "ours_vs_one_reader",
                "broadcast_crc32"} <= set(row)
        assert row["ours_s"] > 0 and row["star_s"] > 0 and row["broadcast_s"] > 0
        assert row["broadcast_vs_ours"] == row["broadcast_s"] / row["ours_s"]
        sent = payload(MIB, row["version"])
        assert sent.nbytes == r["bytes"]  # the same bytes the endpoint arms publish
        assert row["broadcast_crc32"] == zlib.crc32(sent.numpy().data)
    assert r["target_met"] == (r["rows"][-1]["ours_vs_one_reader"] <= r["target"]["max_readers_vs_one"])


def test_reader_order_alternates_racks_and_skips_the_publisher_node():
    state = {"nodes": [{"name": f"n{i}", "rack": "rack1" if i <= 4 else "rack2"} for i in range(1, 9)]}
    assert fanout.reader_order(state) == ["n2", "n5", "n3", "n6", "n4", "n7", "n8"]
    state = {"nodes": [{"name": f"n{i}", "rack": "rack1" if i <= 8 else "rack2"} for i in range(1, 17)]}
    order = fanout.reader_order(state)
    assert len(order) == 15 == len(set(order)) and "n1" not in order and order[:3] == ["n2", "n9", "n3"]


def test_cli_refuses_more_testbed_readers_than_it_carries_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "tensorhub_cli", "bench", "fanout", "--testbed", "--readers",
                           f"1,{fanout.MAX_TESTBED_READERS + 1}"], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert f"the testbed carries {fanout.MAX_TESTBED_READERS} readers at most" in proc.stderr


def test_the_raw_stream_arm_moves_the_payload_and_says_when_it_did_not():
    from tensorhub_cli.bench.testbed import Site

    raw = fanout._raw_stream(8 << 20, Site(None), "n2")  # loopback: what --testbed runs between nodes
    assert raw["cpu_s_per_gib"] == pytest.approx((raw["sender_cpu_s"] + raw["receiver_cpu_s"]) / (8 / 1024))
    streams = raw["streams_cpu_s_per_gib"]  # the figure is the median stream's, not one stream's luck
    assert len(streams) == fanout.RAW_STREAMS and streams == sorted(streams)
    assert raw["cpu_s_per_gib"] == streams[len(streams) // 2]
    assert raw["seconds"] > 0
    # a sender that sends less than the receiver waits for: the row fails, naming why
    port = fanout.free_port()
    rx = subprocess.Popen([sys.executable, "-m", "tensorhub_cli.bench.rawsock", "recv", "--port", str(port),
                           "--nbytes", str(1 << 20), "--timeout-s", "30"], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        subprocess.run([sys.executable, "-m", "tensorhub_cli.bench.rawsock", "send", "--port", str(port),
                        "--nbytes", str(1 << 19), "--timeout-s", "30"], cwd=REPO, check=True, timeout=60,
                       capture_output=True)
        _, err = rx.communicate(timeout=60)
    finally:
        rx.kill()
        rx.wait(10)
    assert rx.returncode != 0 and f"the sender closed after {1 << 19} of {1 << 20} bytes" in err
