"""`th bench fanout --testbed`, small: the three arms really cross the shaped links, read
from the kernel's counters on the publisher's node (n1), not from our bookkeeping.

For N readers, what n1 sent is about one copy per reader under star, and about
ceil(log2(N+1)) copies under gloo's broadcast (a binomial tree: the root sends the whole
payload once per round). Every row is checked bit for bit by the bench itself (it
raises otherwise); the broadcast's CRC-32 is checked here against the payload. No gloo
rank stays behind. Times belong in `th bench`.
"""

from __future__ import annotations

import json
import math
import zlib

import psutil
import pytest

from tensorhub_cli.bench import fanout
from tensorhub_cli.bench.broadcast import payload

from .conftest import require_testbed

pytestmark = pytest.mark.timeout(600)
MIB = 16


def test_fanout_arms_cross_the_links_as_their_shapes_say():
    require_testbed()
    r = fanout.run_testbed([1, 3], mib=MIB, chunk_mib=1, window=4, engine="tcp")
    print(json.dumps(r["rows"]))
    assert r["testbed"]["nodes"] == 4 and r["warmup"] is True
    for row in r["rows"]:
        n = row["readers"]
        assert row["bound_s"] > 0 and row["broadcast_vs_bound"] == row["broadcast_s"] / row["bound_s"]
        assert row["broadcast_crc32"] == zlib.crc32(payload(MIB, row["version"]).numpy().data)
        # payload copies plus TCP/IP headers and control traffic, never a copy more
        assert n <= row["star_publisher_copies"] <= 1.08 * n, row
        rounds = math.ceil(math.log2(n + 1))
        assert rounds <= row["broadcast_publisher_copies"] <= 1.08 * rounds, row
        assert 1 <= row["ours_publisher_copies"] <= 1.08 * n, row
    assert set(r["targets"]) == {"ours_within_1.25x_bound_at_most_readers", "star_vs_ours_at_most_readers_5x",
                                 "ours_no_slower_than_broadcast_at_most_readers"}
    assert r["target_met"] == all(r["targets"].values())
    raw = r["raw_socket"]  # one plain TCP stream n1 -> first reader, checked by CRC-32 in the bench
    assert raw["sender_cpu_s"] > 0 and raw["receiver_cpu_s"] > 0
    for row in r["rows"]:
        per_gib = row["ours_endpoint_cpu_s"] / (row["readers"] * MIB / 1024)
        assert row["ours_cpu_vs_raw_socket"] == pytest.approx(per_gib / raw["cpu_s_per_gib"])
    # The gloo ranks only: the testbed's own teardown is tested elsewhere, and on a shared
    # machine another run's namespaces, hubs or peers would make a broader check lie.
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if any(
        arm in " ".join(p.info["cmdline"] or ()) for arm in ("tensorhub_cli.bench.broadcast", "tensorhub_cli.bench.rawsock"))]
