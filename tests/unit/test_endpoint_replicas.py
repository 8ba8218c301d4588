"""The endpoint's replica table (``endpoint.replicas``): its contract, with a registration
cache that writes down what it is asked (no engine, no hub, no endpoint)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tensorhub_cli.endpoint.replicas import Replicas
from tensorhub_cli.engines import wire
from tensorhub_cli.engines.base import Region
from tensorhub_cli.engines.serve import Regions
from tensorhub_cli.errors import BadArgument, EndpointError


class FakeRegistrations:
    """Hands out a fresh registration per ``acquire`` and logs every call."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.engine = SimpleNamespace(kind="fake", describe=lambda handle: b"desc:" + handle.encode())

    def acquire(self, model, placed, owned=None, *, fill=False):
        reg = SimpleNamespace(handle=f"{model}#{len(self.calls)}")
        self.calls.append(("acquire", reg))
        return reg

    def give_back(self, reg) -> None:
        self.calls.append(("give_back", reg))

    def drop(self, reg) -> None:
        self.calls.append(("drop", reg))


def placed(addr: int, nbytes: int = 64, device: int = -1) -> SimpleNamespace:
    return SimpleNamespace(regions=[Region(addr, nbytes, device)], device=device, views=[None])


def table(tier: str = "host") -> tuple[Replicas, FakeRegistrations, Regions]:
    regs, served = FakeRegistrations(), Regions()
    return Replicas("e", tier, regs, served), regs, served


def test_adding_a_version_held_already_names_it_and_gives_its_registration_back():
    replicas, regs, served = table()
    first = replicas.register("m", 1, 1, [], 0, placed(0x1000))
    second = replicas.register("m", 1, 1, [], 0, placed(0x2000))  # two threads, neither added yet
    replicas.add(first)
    with pytest.raises(EndpointError, match=r"^e already holds m@1$"):
        replicas.add(second)
    assert regs.calls[-1] == ("give_back", second.reg)
    assert replicas.get(("m", 1)) is first and replicas.all() == [first] and len(replicas) == 1
    assert served.contains(0x1000, 64) and not served.contains(0x2000, 64)
    with pytest.raises(EndpointError, match=r"^e already holds m@1$"):  # held now: refused before registering
        replicas.register("m", 1, 1, [], 0, placed(0x3000))
    assert [what for what, _ in regs.calls] == ["acquire", "acquire", "give_back"]


def test_a_claim_on_a_version_claimed_already_waits_and_gives_up_at_the_deadline_naming_it():
    replicas, _, _ = table()
    with replicas.claim(("m", 7), time.monotonic() + 5):
        began = time.monotonic()
        with pytest.raises(EndpointError, match=r"^e is still setting up another fetch of m@7; "
                                                r"gave up at the fetch's timeout$"):
            with replicas.claim(("m", 7), began + 0.3):
                pytest.fail("one version claimed twice at once")
        assert 0.25 <= time.monotonic() - began < 3
        with replicas.claim(("m", 8), time.monotonic()):  # another version: at once
            pass
    with replicas.claim(("m", 7), time.monotonic()):  # let go: free at once
        pass


def test_a_claim_waits_for_the_one_before_it_to_let_go():
    replicas, _, _ = table()
    inside, order = threading.Event(), []

    def first() -> None:
        with replicas.claim(("m", 1), time.monotonic() + 5):
            inside.set()
            time.sleep(0.3)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(5)
    with replicas.claim(("m", 1), time.monotonic() + 5):
        order.append("second in")
    t.join(5)
    assert order == ["first out", "second in"]


@pytest.mark.parametrize("registration, called", [
    (None, "give_back"),  # the default
    ("give_back", "give_back"),
    ("drop", "drop"),
    ("keep", None),  # zombies own it: the cache is not told
])
def test_drop_lets_the_replica_go_and_its_registration_as_told(registration, called):
    replicas, regs, served = table()
    held = replicas.register("m", 1, 1, [], 0, placed(0x1000))
    replicas.add(held)
    regs.calls.clear()
    if registration is None:
        replicas.drop(held)
    else:
        replicas.drop(held, registration=registration)
    assert regs.calls == ([] if called is None else [(called, held.reg)])
    assert ("m", 1) not in replicas and replicas.get(("m", 1)) is None and replicas.all() == []
    assert held.dropped, "a wait for its chunks would never be answered"
    assert not served.contains(0x1000, 64)


@pytest.mark.parametrize("tier, device, what, words", [
    ("host", 0, "into", "into: its tensors are in cuda:0, but e joined with tier 'host'; "
                        "connect with device='cuda:0'"),
    ("device", -1, "state_dict", "state_dict: its tensors are in host memory, but e joined with tier 'device'; "
                                 "connect with device='cpu'"),
])
def test_memory_of_the_other_tier_is_a_bad_argument_naming_it_before_anything_registers(tier, device, what, words):
    replicas, regs, _ = table(tier)
    with pytest.raises(BadArgument) as exc:
        replicas.check_tier(placed(0x1000, device=device), what)
    assert str(exc.value) == words
    assert replicas.check_tier(placed(0x1000, device=-1 if tier == "host" else 0), what) is None
    assert regs.calls == []


def test_overlapping_and_describe_answer_from_the_table():
    replicas, _, _ = table()
    held = replicas.register("m", 1, 1, [], 0, placed(0x1000))
    replicas.add(held)
    assert replicas.overlapping([Region(0x1030, 64, -1)]) == [held]
    assert replicas.overlapping([Region(0x1040, 64, -1), Region(0x1000, 64, 0)]) == []  # after it; another device
    assert replicas.describe(wire.Describe(model="m", version=1)).description == b"desc:" + held.handle.encode()
    refused = replicas.describe(wire.Describe(model="m", version=2))
    assert isinstance(refused, wire.Refused) and refused.code == "not_found" and "m@2" in refused.message
