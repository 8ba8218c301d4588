"""The flow model alone: max-min fair shares and flow timing, against closed forms."""

import pytest

from tensorhub_cli.sim.events import Loop
from tensorhub_cli.sim.network import Network, max_min


def test_two_flows_on_one_link_get_half_each():
    assert max_min({1: [0], 2: [0]}, [10.0]) == {1: 5.0, 2: 5.0}


def test_a_flow_held_elsewhere_leaves_the_rest_to_others():
    # flow 1 crosses the shared link 0 and a slow link 1; flow 2 only link 0
    rates = max_min({1: [0, 1], 2: [0]}, [10.0, 2.0])
    assert rates[1] == pytest.approx(2.0)
    assert rates[2] == pytest.approx(8.0)


def test_progressive_filling_over_a_chain_of_links():
    # classic: flows a (links 0,1), b (link 0), c (link 1); caps 1 and 2
    rates = max_min({"a": [0, 1], "b": [0], "c": [1]}, [1.0, 2.0])
    assert rates == pytest.approx({"a": 0.5, "b": 0.5, "c": 1.5})


def _net(exact=True):
    loop = Loop()
    return loop, Network(loop, 0.0, 0.0 if exact else 0.05)


def test_one_flow_takes_size_over_rate():
    loop, net = _net()
    link = net.link(100.0)
    done = []
    net.start([link], 1000, lambda: done.append(loop.now))
    loop.run()
    assert done == [pytest.approx(10.0)]


def test_sharing_then_speeding_up_when_the_other_ends():
    # both share 100 B/s: the 500-byte flow ends at 10 s, the other has 500 left at full rate
    loop, net = _net()
    link = net.link(100.0)
    done = {}
    net.start([link], 500, lambda: done.setdefault("short", loop.now))
    net.start([link], 1000, lambda: done.setdefault("long", loop.now))
    loop.run()
    assert done["short"] == pytest.approx(10.0)
    assert done["long"] == pytest.approx(15.0)


def test_a_stopped_flow_frees_its_share():
    loop, net = _net()
    link = net.link(100.0)
    done = {}
    a = net.start([link], 1000, lambda: done.setdefault("a", loop.now))
    net.start([link], 1000, lambda: done.setdefault("b", loop.now))
    loop.at(4.0, net.stop, a)  # b moved 200 by then, 800 left alone
    loop.run()
    assert "a" not in done
    assert done["b"] == pytest.approx(12.0)


def test_the_rate_quantum_never_overfills_a_link_and_stays_close():
    exact, approx = [], []
    for out, flag in ((exact, True), (approx, False)):
        loop, net = _net(flag)
        link = net.link(100.0)
        for k in range(8):  # staggered starts: every start changes every rate
            loop.at(k * 0.7, net.start, [link], 300, lambda out=out, loop=loop: out.append(loop.now))
        loop.run()
    assert len(exact) == len(approx) == 8
    assert max(exact) == pytest.approx(24.0)  # the link is never idle: 2400 bytes at 100 B/s
    # a link is never given more than its rate, so the last byte is never early
    assert max(approx) >= max(exact) - 1e-9
    for e, a in zip(sorted(exact), sorted(approx)):
        assert a == pytest.approx(e, rel=0.1)
