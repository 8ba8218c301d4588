"""A publish the hub will not keep is refused in one line naming what it holds; a
republish with other bytes names ``th unpublish MODEL V`` (the pure hub, no sockets)."""

from __future__ import annotations

import pytest

from tensorhub_cli.hub import protocol as p
from tensorhub_cli.hub.machine import HubFault
from tensorhub_cli.hub.retention import Policy

from .hubkit import info, manifest, new_hub, reg


def publish(hub, name, version, m, rank=0, world=1, model="policy"):
    hub.publish(0, p.Publish(name=name, model=model, version=version, manifest=m, rank=rank, world=world))


def refused(hub, *args, **kw) -> HubFault:
    before = {n: (v.state, sorted(v.replicas)) for n, v in hub.models.get("policy", {}).items()}
    with pytest.raises(HubFault) as exc:
        publish(hub, *args, **kw)
    assert {n: (v.state, sorted(v.replicas)) for n, v in hub.models.get("policy", {}).items()} == before
    assert "\n" not in exc.value.message
    return exc.value


def test_a_version_older_than_keep_latest_keeps_is_refused_naming_the_versions_held():
    hub = new_hub(policies={"policy": Policy(keep_latest=2, min_reliable_copies=0)})
    reg(hub, 0, info("t"), info("u", node="n2"))
    publish(hub, "t", 2, manifest(2, salt=2))
    publish(hub, "t", 3, manifest(2, salt=3))
    fault = refused(hub, "u", 1, manifest(2, salt=1))
    assert fault.code == "stale"
    assert "policy@1" in fault.message and "policy@3, 2" in fault.message and "keep_latest" in fault.message
    assert "publish policy@4 or later" in fault.message
    assert 1 not in hub.models["policy"]


def test_a_version_between_the_kept_ones_or_above_them_is_kept():
    hub = new_hub(policies={"policy": Policy(keep_latest=2, min_reliable_copies=0)})
    reg(hub, 0, info("t"), info("u", node="n2"))
    publish(hub, "t", 2, manifest(2, salt=2))
    publish(hub, "t", 5, manifest(2, salt=5))
    publish(hub, "u", 4, manifest(2, salt=4))  # pushes 2 out, not itself
    assert sorted(hub.models["policy"]) == [4, 5] and hub.models["policy"][4].state == "READY"
    publish(hub, "u", 7, manifest(2, salt=7))
    assert sorted(hub.models["policy"]) == [5, 7]


def test_staging_versions_do_not_count_and_a_known_ready_version_may_take_its_shard_again():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=0)})
    reg(hub, 0, info("t0"), info("t1", node="n2"), info("u", node="n3"))
    publish(hub, "t0", 3, manifest(2, salt=3), rank=0, world=2)  # STAGING: keeps nothing yet
    publish(hub, "u", 2, manifest(2, salt=2))
    assert hub.models["policy"][2].state == "READY"
    publish(hub, "t1", 3, manifest(2, salt=4), rank=1, world=2)  # 3 READY: 2 goes
    assert sorted(hub.models["policy"]) == [3]
    publish(hub, "t0", 3, manifest(2, salt=3), rank=0, world=2)  # the same shard again: fine
    assert refused(hub, "u", 2, manifest(2, salt=2)).code == "stale"


def test_withdrawn_versions_do_not_keep_an_older_one_out():
    hub = new_hub(policies={"policy": Policy(keep_latest=1, min_reliable_copies=0)})
    reg(hub, 0, info("t"), info("r", node="n2"))
    publish(hub, "t", 5, manifest(2, salt=5))
    hub.plan(0, p.Plan(name="r", model="policy", version=5, window=1))  # a pin: the withdrawal waits
    hub.withdraw(0, p.Withdraw(model="policy", version=5, timeout_s=60))
    publish(hub, "t", 4, manifest(2, salt=4))  # 5 is on its way out: 4 is what retention keeps
    assert hub.models["policy"][4].state == "READY"


def test_no_policy_limit_refuses_nothing():
    hub = new_hub(policies={"policy": Policy(keep_latest=0, min_reliable_copies=0)})
    reg(hub, 0, info("t"))
    for number in (3, 1):
        publish(hub, "t", number, manifest(2, salt=number))
    assert sorted(hub.models["policy"]) == [1, 3]


def test_republishing_other_bytes_under_a_held_number_names_th_unpublish():
    hub = new_hub()
    reg(hub, 0, info("t"), info("u", node="n2"))
    publish(hub, "t", 1, manifest(2, salt=1))
    fault = refused(hub, "u", 1, manifest(2, salt=9))
    assert fault.code == "conflict" and "different manifest" in fault.message
    assert "th unpublish policy 1" in fault.message
    fault = refused(hub, "u", 1, manifest(2, salt=1), world=2)
    assert fault.code == "conflict" and "world 1" in fault.message and "th unpublish policy 1" in fault.message
