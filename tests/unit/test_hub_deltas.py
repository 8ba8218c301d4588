"""``Read.base`` (hub/deltas.py): a read carries the newest older version both ends
hold the chunk of, across DC links by default, within a DC only in mode "all", never
onto a base that either end is draining or whose chunk differs in size."""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.retention import Policy

from .hubkit import fetch_all, info, manifest, new_hub, reg

M = "m"


def _hub(reader_dc="dc2", versions=(1, 2), sizes=None, **config):
    hub = new_hub(**config)
    reg(hub, 0.0, info("t0", node="t", rack="rt", dc="dc1"), info("r", node="n", rack="rr", dc=reader_dc))
    for v in versions:
        size = (sizes or {}).get(v, 1024)
        hub.publish(0.0, p.Publish(name="t0", model=M, version=v, manifest=manifest(4, size, salt=0), rank=0,
                                   world=1))
    return hub


def _bases(hub, version):
    planned = hub.plan(0.0, p.Plan(name="r", model=M, version=version, schedule=True))
    assert planned.listed(), planned
    return {r.base for r in planned.listed()}


def test_a_far_reader_of_v2_that_holds_v1_is_told_to_read_deltas_against_v1():
    hub = _hub()
    assert _bases(hub, 1) == {-1}  # nothing older is held
    fetch_all(hub, 0.0, "r", M, 1)
    assert _bases(hub, 2) == {1}


def test_the_newest_base_both_hold_is_chosen():
    hub = _hub(versions=(1, 2), policies={M: Policy(3, 0)})
    fetch_all(hub, 0.0, "r", M, 1)
    fetch_all(hub, 0.0, "r", M, 2)
    hub.publish(0.0, p.Publish(name="t0", model=M, version=3, manifest=manifest(4), rank=0, world=1))
    assert _bases(hub, 3) == {2}


@pytest.mark.parametrize("mode, same_dc, want", [
    ("remote", False, {1}), ("remote", True, {-1}), ("all", True, {1}), ("off", False, {-1})])
def test_the_mode_decides_which_links_carry_deltas(mode, same_dc, want):
    hub = _hub(reader_dc="dc1" if same_dc else "dc2", default_deltas=mode)
    fetch_all(hub, 0.0, "r", M, 1)
    assert _bases(hub, 2) == want


def test_a_per_model_mode_overrides_the_default():
    hub = _hub(deltas={M: "off"})
    fetch_all(hub, 0.0, "r", M, 1)
    assert _bases(hub, 2) == {-1}


def test_no_base_whose_chunk_differs_in_size():
    hub = _hub(sizes={1: 1024, 2: 2048})
    fetch_all(hub, 0.0, "r", M, 1)
    assert _bases(hub, 2) == {-1}


def test_no_base_the_reader_does_not_hold():
    hub = _hub()
    assert _bases(hub, 2) == {-1}


def test_no_base_the_source_unpublished():
    hub = _hub()
    fetch_all(hub, 0.0, "r", M, 1)
    hub.unpublish(0.0, p.Unpublish(name="t0", model=M, version=1))
    assert _bases(hub, 2) == {-1}
