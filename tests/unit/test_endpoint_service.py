"""The endpoint's service thread (endpoint.service) with a fake hub client: its socket
is never used by two threads, nor closed under the thread still using it."""

from __future__ import annotations

import select
import threading
import time
from types import SimpleNamespace

import pytest

from tensorhub_cli.endpoint.service import Service
from tensorhub_cli.hub import protocol as p


class SlowClient:
    """Heartbeats take ``beat_s``; records any call or close that overlaps another."""

    def __init__(self, beat_s: float):
        self.beat_s = beat_s
        self.busy = threading.Lock()
        self.overlaps: list[str] = []
        self.closed = threading.Event()
        self.pushed: list = []
        self.beating = threading.Event()

    def _enter(self, what: str) -> None:
        if not self.busy.acquire(blocking=False):
            self.overlaps.append(what)
            self.busy.acquire()

    def call(self, op, timeout: float = 5.0):
        self._enter(type(op).__name__)
        try:
            if self.closed.is_set():
                self.overlaps.append(f"{type(op).__name__} after close")
            if isinstance(op, p.Heartbeat):
                self.beating.set()
                time.sleep(self.beat_s)
            return p.Ok()
        finally:
            self.busy.release()

    def poll_pushed(self, timeout: float, wake: int | None = None) -> None:
        time.sleep(timeout)

    def close(self) -> None:
        self._enter("close")
        self.closed.set()
        self.busy.release()


def fake_endpoint() -> SimpleNamespace:
    return SimpleNamespace(name="e", incarnation="i1", info=p.EndpointInfo(name="e", node="n", incarnation="i1"),
                           holdings=lambda: [], filling=lambda: [], holds_memory=lambda: False,
                           engine=SimpleNamespace(needs_progress=False), peer=SimpleNamespace(last_ask=0.0),
                           reap=lambda call: None, heard_at=float("-inf"))


def test_stop_never_uses_or_closes_the_socket_while_the_thread_still_does():
    client = SlowClient(beat_s=1.0)
    service = Service(fake_endpoint(), client, heartbeat_s=0.05, handler=lambda ep, cmd: None)
    service.start()
    assert service.registered.wait(5)
    assert client.beating.wait(5)  # the thread is inside a slow heartbeat now
    service.stop(join_timeout=0.1, deregister_timeout=0.1)
    assert client.closed.wait(5), "the socket was never closed"
    assert not client.overlaps, client.overlaps
    service._thread.join(5)
    assert not service._thread.is_alive()


class WakeableClient:
    """Waits on the hub socket far longer than a slice, unless ``wake`` is readable."""

    def __init__(self):
        self.calls: list[str] = []
        self.pushed: list = []

    def call(self, op, timeout: float = 5.0):
        self.calls.append(type(op).__name__)
        return p.Ok()

    def poll_pushed(self, timeout: float, wake: int | None = None) -> None:
        select.select([wake] if wake is not None else [], [], [], 30.0)

    def close(self) -> None:
        self.calls.append("close")


def test_stop_cuts_the_wait_on_the_hub_socket_short():
    client = WakeableClient()
    service = Service(fake_endpoint(), client, heartbeat_s=60.0, handler=lambda ep, cmd: None)
    service.start()
    assert service.registered.wait(5)
    started = time.monotonic()
    service.stop(join_timeout=5, deregister_timeout=0.1)
    assert time.monotonic() - started < 1.0
    assert client.calls == ["Register", "Deregister", "close"]  # the thread ended: stop deregistered
    service.stop(join_timeout=5, deregister_timeout=0.1)  # a second stop is a no-op
    assert client.calls == ["Register", "Deregister", "close"]


class PushingClient:
    """Beats at once; hands the service the commands a test pushes."""

    def __init__(self):
        from collections import deque

        self.pushed = deque()

    def call(self, op, timeout: float = 5.0):
        return p.Ok()

    def poll_pushed(self, timeout: float, wake: int | None = None) -> None:
        time.sleep(min(timeout, 0.01))

    def close(self) -> None:
        pass


def test_a_retention_pull_never_waits_behind_a_long_sync_fetch():
    client = PushingClient()
    fetching, done = threading.Event(), threading.Event()
    seen: list[str] = []

    def handler(ep, cmd):
        seen.append(cmd.action)
        if cmd.action == "fetch":  # a `th sync` fetch that takes minutes
            fetching.set()
            done.wait(10)

    service = Service(fake_endpoint(), client, heartbeat_s=0.05, handler=handler)
    service.start()
    try:
        client.pushed.append(p.Command(action="fetch", model="m", version=1))
        assert fetching.wait(5)
        client.pushed.extend([p.Command(action="retain", model="m", version=2),
                              p.Command(action="discard", model="m", version=0),
                              p.Command(action="fetch", model="m", version=3)])
        deadline = time.monotonic() + 3
        while seen[1:3] != ["retain", "discard"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == ["fetch", "retain", "discard"], seen  # the second fetch still waits its turn
    finally:
        done.set()
        service.stop(join_timeout=2, deregister_timeout=0.5)


def test_a_replan_wakes_the_fetch_filling_that_version_and_no_handler_sees_it():
    client = PushingClient()
    woken, seen = threading.Event(), []
    filling = SimpleNamespace(replan=woken.set)
    ep = fake_endpoint()
    ep.replicas = SimpleNamespace(get=lambda key: {("m", 1): filling, ("m", 2): SimpleNamespace(replan=None)}.get(key))
    service = Service(ep, client, heartbeat_s=0.05, handler=lambda ep, cmd: seen.append(cmd.action))
    service.start()
    try:
        # (a version nobody fills here, and one whose fetch is over: nothing to wake, nothing raised)
        client.pushed.extend([p.Command(action="replan", model="m", version=9),
                              p.Command(action="replan", model="m", version=2),
                              p.Command(action="replan", model="m", version=1),
                              p.Command(action="fetch", model="m", version=3)])
        assert woken.wait(5), "the fetch filling m@1 was not woken"
        deadline = time.monotonic() + 3
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == ["fetch"] and service._thread.is_alive()
    finally:
        service.stop(join_timeout=2, deregister_timeout=0.5)


class RefusingClient(PushingClient):
    """The hub refuses every request, ``code`` its reason; counts the calls."""

    address = "tcp://hub:1"

    def __init__(self, code: str):
        super().__init__()
        self.code, self.calls = code, []

    def call(self, op, timeout: float = 5.0):
        from tensorhub_cli.errors import HubError

        self.calls.append(type(op).__name__)
        raise HubError(p.Error(code=self.code, message="bad cluster token"))


def test_a_bad_token_is_final_at_once_in_one_log_line(caplog):
    from tensorhub_cli.errors import HubError

    client = RefusingClient("auth")
    service = Service(fake_endpoint(), client, heartbeat_s=0.05, handler=lambda ep, cmd: None)
    started = time.monotonic()
    service.start()
    try:
        service._thread.join(2)
        assert not service._thread.is_alive(), f"the service thread goes on after a final refusal: {client.calls}"
        assert client.calls == ["Register"]
        with pytest.raises(HubError) as exc:
            service.wait_registered(10.0)
        assert time.monotonic() - started < 2.0
        assert exc.value.code == "auth" and "bad cluster token" in str(exc.value) and "tcp://hub:1" in str(exc.value)
        assert "\n" not in str(exc.value)
        assert len([r for r in caplog.records if r.name == "tensorhub.endpoint"]) == 1
    finally:
        service.stop(join_timeout=2, deregister_timeout=0.5)
    assert client.calls == ["Register"]  # no Deregister the hub would refuse the same way


def test_a_refusal_a_retry_can_change_is_retried():
    client = RefusingClient("internal")
    service = Service(fake_endpoint(), client, heartbeat_s=0.05, handler=lambda ep, cmd: None)
    service.start()
    try:
        assert service.wait_registered(0.3) is False
        assert len(client.calls) > 1
    finally:
        service.stop(join_timeout=2, deregister_timeout=0.5)


class CountingClient(PushingClient):
    """Counts the beats the service sends."""

    def __init__(self):
        super().__init__()
        self.beats: list[float] = []

    def call(self, op, timeout: float = 5.0):
        if isinstance(op, p.Heartbeat):
            self.beats.append(time.monotonic())
        return p.Ok()


def test_a_beat_due_within_a_period_of_an_answered_plan_is_put_off_never_dropped():
    """The hub takes a plan for a heartbeat (``reading.plan`` sets ``last_seen``): while
    plans keep being answered the service sends no beats; once they stop, it beats again
    within a period of the last answer."""
    client, ep = CountingClient(), fake_endpoint()
    service = Service(ep, client, heartbeat_s=0.2, handler=lambda ep, cmd: None)
    service.start()
    try:
        assert service.registered.wait(5)
        time.sleep(0.5)
        assert client.beats, "no beats while no plans were answered"
        until = time.monotonic() + 1.0
        while time.monotonic() < until:  # a fetch: the hub answers a plan every 50 ms
            ep.heard_at = time.monotonic()
            time.sleep(0.05)
        quiet = [t for t in client.beats if until - 0.8 < t < until]
        assert not quiet, f"{len(quiet)} beats while plans were being answered"
        time.sleep(0.6)
        after = [t for t in client.beats if t > until]
        assert after and after[0] - until <= 0.2 + 0.1, (after, until)  # a period after the last answer
    finally:
        service.stop(join_timeout=1, deregister_timeout=0.1)


class PacedEngine:
    """An engine that needs progress and records the paces it is given."""

    needs_progress = True

    def __init__(self, on_pace=None):
        self.paces: list = []
        self.on_pace = on_pace

    def pace(self, every_s):
        self.paces.append(every_s)
        if self.on_pace:
            self.on_pace()


def test_the_engine_is_paced_hot_while_peers_read_us_warm_while_we_hold_and_not_at_all_otherwise():
    from tensorhub_cli.endpoint.service import HOT_S, WARM_S

    holding = {"yes": False}
    ep = fake_endpoint()
    ep.engine, ep.holds_memory = PacedEngine(), lambda: holding["yes"]
    service = Service(ep, SlowClient(beat_s=0.0), heartbeat_s=1.0, handler=lambda ep, cmd: None, hot_s=30.0)
    ep.peer.last_ask = 100.0
    service._pace(now=110.0)
    assert ep.engine.paces[-1] is None  # (nothing of ours to read)
    holding["yes"] = True
    service._pace(now=110.0)
    assert ep.engine.paces[-1] == HOT_S
    service._pace(now=131.0)
    assert ep.engine.paces[-1] == WARM_S

    def ask_meanwhile():  # a peer's ask lands between reading ``last_ask`` and pacing
        if ep.engine.paces[-1] == WARM_S:
            ep.peer.last_ask = 131.0

    ep.engine.on_pace = ask_meanwhile
    service._pace(now=131.0)
    assert ep.engine.paces[-2:] == [WARM_S, HOT_S], "a slower pace overrode the ask that came meanwhile"


def test_a_peers_ask_paces_the_engine_hot_at_once():
    """The ask itself (the peer server's thread) speeds serving up, not the service's next slice."""
    from tensorhub_cli.endpoint.endpoint import Endpoint
    from tensorhub_cli.endpoint.service import HOT_S

    ep = SimpleNamespace(engine=PacedEngine())
    Endpoint._asked(ep)
    assert ep.engine.paces == [HOT_S]
    ep.engine.needs_progress = False
    Endpoint._asked(ep)
    assert ep.engine.paces == [HOT_S]


def test_a_real_hub_client_stops_waiting_for_pushes_once_woken():
    import os

    from tensorhub_cli.hub.client import HubClient

    client = HubClient("tcp://127.0.0.1:9", "token")  # nothing there: no push ever comes
    wake, waker = os.pipe()
    try:
        threading.Timer(0.1, os.write, (waker, b"x")).start()
        started = time.monotonic()
        client.poll_pushed(10.0, wake=wake)
        assert time.monotonic() - started < 2.0
        assert not client.pushed
        started = time.monotonic()
        client.poll_pushed(0.05)  # no wake: the whole slice
        assert time.monotonic() - started >= 0.04
    finally:
        client.close()
        os.close(wake)
        os.close(waker)
