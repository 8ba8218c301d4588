"""The endpoint: what a trainer rank, rollout rank or agent links to hold and fetch weights.

Protocol (per method, what the caller may do once it returns):

- ``publish(model, version, state_dict, shard=(rank, world), timeout=10, ready=None)``
  (``publishing``): once it returns the tensors are registered where they lie and the
  hub has the manifest; the caller must not change them until ``unpublish`` of that
  version has returned (contract 3). ``EndpointError`` saying "withdrawn": the hub
  never kept it, the tensors are the caller's again.
- ``fetch(model, version|"latest", into=state_dict, group=..., timeout=..., wait=True)``
  → the version number (``fetching``; ``collective=pg``: ``collective``). A version not
  READY yet is waited for within ``timeout`` (``waiting``). ``into`` maps names to
  tensors, DTensors or ``layout.Target``s (engine layouts: contract 9). On return
  every byte it needs is verified and in ``into`` (visible on the caller's current
  CUDA stream), and ``into`` is published memory under the same rule as ``publish``.
  ``group`` defaults to the endpoint's own (contract 2, whoever calls). On
  ``FetchError`` (or ``LayoutError`` before any byte moved) the endpoint holds no
  replica in ``into``; its contents are undefined, and it is the caller's again.
- ``resolve(model, version|"latest", group=..., timeout=..., wait=True)`` → the
  version's resolution (``hub.protocol.Resolved``: number, manifests), as a fetch's
  first step does it; it pins nothing. Passed to ``fetch`` as the version (here or
  in another member's process: it pickles), that fetch asks the hub nothing to name
  it, so the members of a model-parallel group resolve once between them (the vLLM
  and SGLang adapters' TP ranks do: ``adapters.agree``). Its manifests are trusted as
  the hub's answer (their checksums verify every chunk), so pass only one a process of
  your own engine made. A resolution of another model, or one without manifests, is
  ``BadArgument``; one whose version was withdrawn since fails at the fetch's plan.
- ``unpublish(model, version)``: returns once the hub acknowledged the drain: no read
  of that memory is in flight, and any retention copy it called for exists. The caller
  owns the memory again.
- ``verify(model, version, into)`` → problems (empty: ``into`` is byte for byte the
  version, re-hashed against the manifest). Reads only; changes nothing.
- ``discard(model, version)``: drops the replica without a drain (the hub forgot it
  already) and deregisters its memory; the caller owns the memory again.
- ``report(cmd, kind, message)``: tells the hub how a command went (best effort).
- ``close()``: unpublishes everything and waits for reads a failed fetch left running
  (each bounded by ``drain_timeout``), deregisters, stops its threads and engines.

Registrations (``registrations``): memory published or fetched into again is
registered with the engine once, and kept (unused) within ``reg_cache_bytes``; memory
a given-up read may still write is fenced (``zombies``).

Errors are those of ``tensorhub_cli.errors`` (all ``TensorHubError``): a bad argument
raises ``BadArgument`` naming it before anything changed; any call after ``close``
raises ``EndpointError`` saying the endpoint is closed.

Commands the hub pushes run through ``on_command`` (default: ``SyncCommands``, which
serves ``th sync`` into what ``accept_sync`` named); see ``commands`` for what a
handler may do.

Timeouts, each set at construction (``tensorhub_cli.api.connect`` says what each
bounds; the cluster spec's ``endpoints`` through ``connect(cluster=...)``) and, where a
method takes one, per call: ``heartbeat_s``, ``read_timeout_s``, ``plan_timeout_s``,
``drain_timeout_s`` (also a failed fetch's withdrawal of its partial replica),
``call_timeout_s``, ``connect_timeout``, ``peer_idle_s``, ``conn_idle_s`` (keep it
below the holders' ``peer_idle_s``).

Threads: the caller's (publish, fetch, unpublish), the service thread (register,
heartbeat, the engine's serving pace), the command workers (the handler), the peer
server (``peer``), the verifier pool, the tcp engine's read pool and the engine's
watcher (our reads' ends; the engine's progress at that pace). Every thread that calls
the hub has a hub socket of its own (``hub_sockets``), so an unpublish waiting for its
drain holds up no other thread's call. Replica records are shared under the replica
table's lock (``replicas``).

Plumbing: what the endpoint's collaborators (``publishing``, ``fetching``,
``collective``, ``fetch``, ``scheduled``, ``service``, the command handlers) may use of
it, and nothing private: ``replicas`` (the replica table: ``Replicas``, whose module
says who changes it under which lock); ``call(op, timeout)`` (the hub's answer, on the
calling thread's own socket; ``HubError`` ``fenced`` once we were replaced);
``call_once`` (the same on a socket made and closed for the one call: short-lived
threads); ``check_open()`` (``EndpointError`` once closed); ``await_registered(timeout)``
(returns once the hub took our registration); ``reap(call)`` (the service thread's
beat: zombies whose reads ended); ``hub_client()``, ``heard()``, ``token``,
``registrations``, ``zombies``, ``served``, ``engine``/``tcp``, ``verifiers``.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import msgspec

from ..engines import choice
from ..engines.serve import Regions
from ..engines.tcp import IDLE_S as TCP_IDLE_S
from ..errors import BadArgument
from ..hub import protocol as p
from ..hub.client import HubClient, HubError, HubUnreachable
from ..layout import CHUNK_BYTES, SMALL_BYTES, verify
from . import checks, fetching, publishing
from .commands import CommandHandler, SyncCommands
from .errors import EndpointError
from .hub_sockets import HubSockets
from .peer import IDLE_S as PEER_IDLE_S
from .peer import PeerServer
from .registrations import REG_CACHE_BYTES, Registrations, cap_bytes
from .replicas import Replicas
from .service import HOT_S, Service
from .zombies import Zombies

log = logging.getLogger("tensorhub.endpoint")


class Endpoint:
    def __init__(self, hub: str, token: str, info: p.EndpointInfo, *, host: str = "127.0.0.1",
                 engine: str = "nixl", heartbeat_s: float = 1.0, read_timeout_s: float = 30.0,
                 plan_timeout_s: float = 5.0, drain_timeout_s: float = 120.0, call_timeout_s: float = 5.0,
                 connect_timeout: float = 10.0, on_command: Optional[CommandHandler] = None,
                 chunk_bytes: int = CHUNK_BYTES, small_bytes: int = SMALL_BYTES,
                 peer_idle_s: float = PEER_IDLE_S, conn_idle_s: float = TCP_IDLE_S,
                 reg_cache_bytes: int = REG_CACHE_BYTES, schedule: bool | None = None):
        self.name = info.name
        # Fetches read a schedule (endpoint/scheduled.py), or (False; TH_FETCH=window)
        # plan a window at a time (endpoint/fetch.py).
        self.schedule = os.environ.get("TH_FETCH", "schedule") != "window" if schedule is None else schedule
        self.host = host
        self._token = token
        self.chunk_bytes = chunk_bytes
        self.small_bytes = small_bytes
        self.read_timeout_s = read_timeout_s
        self.plan_timeout_s = plan_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.call_timeout_s = call_timeout_s
        self.served = Regions()
        reg_cache_bytes = cap_bytes(reg_cache_bytes)  # (checked before an engine exists to leak)
        self.engine, self.tcp = choice.make(engine, info.name, token, host, conn_idle_s)
        self._registrations = Registrations(self.engine, reg_cache_bytes)
        self.replicas = Replicas(self.name, info.tier, self._registrations, self.served)
        # Checksums of fetched chunks, off the fetch loop's thread (the hash releases the GIL).
        self.verifiers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="th-verify")
        self.peer = PeerServer(host, token, self.replicas.describe, self.served, idle_s=peer_idle_s,
                               replica=self.replicas.get, on_ask=self._asked)
        # A fresh incarnation per Endpoint: re-registering with it after a slow beat keeps
        # our pins and pending unpublish at the hub; a newer process under our name
        # fences this one (contract 3). A supervised runner's first Endpoint takes the
        # id its supervisor chose (TH_INCARNATION, consumed once), so the supervisor can
        # deregister exactly this incarnation when the process dies (agent.supervise).
        incarnation = os.environ.pop("TH_INCARNATION", "") or uuid.uuid4().hex
        self.info = msgspec.structs.replace(info, engine=self.engine.kind, engine_meta=self.peer.address.encode(),
                                            incarnation=incarnation)
        self.incarnation = self.info.incarnation
        # transfers that could not be released yet (contract 3: they stay pinned)
        self.zombies = Zombies(self.name, self.incarnation, self.replicas.get, call_timeout_s,
                               hub_call=self.call_once, drain_timeout_s=drain_timeout_s,
                               let_go=self._registrations.give_back)
        self._hub = hub
        self._sockets = HubSockets(self.hub_client)  # one hub socket per calling thread (``hub_sockets``)
        # When the hub last answered one of our plans (monotonic): the hub takes a plan
        # for a heartbeat, so the service thread skips a beat due sooner than
        # ``heartbeat_s`` after it (a fetch's plans are most of a reader's requests).
        self.heard_at = float("-inf")
        self.last_fetch: dict = {}
        self.sync_into: dict[str, dict | Callable[[list[p.Manifest]], dict]] = {}
        self.service = Service(self, HubClient(hub, token, source=host), heartbeat_s, on_command or SyncCommands())
        self.service.start()
        try:
            self.await_registered(connect_timeout)
        except BaseException:
            self.close(drain_timeout=0)
            raise

    # --- plumbing: what collaborators may use (the module's "Plumbing") ----------------

    @property
    def token(self) -> str:
        """The cluster token the hub and our peers' servers ask of every request."""
        return self._token

    def hub_client(self) -> HubClient:
        """A hub socket of the caller's own, from our node's address: for a thread that
        drives its own requests (a fetch's plans). The caller closes it."""
        return HubClient(self._hub, self._token, source=self.host)

    def heard(self) -> None:
        """The hub answered a plan of ours just now (it counts as our heartbeat)."""
        self.heard_at = time.monotonic()

    def check_open(self) -> None:
        """Returns while the endpoint is open; after ``close``: ``EndpointError``."""
        if getattr(self, "_shut", False):
            raise EndpointError(f"endpoint {self.name} is closed; connect again to use the hub")

    def call(self, op: p.Op, timeout: float) -> p.Body:
        """The hub's answer to ``op`` on this thread's own hub socket (``HubError``: its
        refusal, ``fenced`` once we were replaced; ``HubUnreachable``: none in time)."""
        self._may_call()
        return self._sockets.mine().call(op, timeout=timeout)

    def call_once(self, op: p.Op, timeout: float) -> p.Body:
        """``call`` on a socket of its own, closed here: for short-lived threads (a
        zombie's withdrawal), whose socket ``close`` must not close under them."""
        self._may_call()
        client = self.hub_client()
        try:
            return client.call(op, timeout=timeout)
        finally:
            client.close()

    def _may_call(self) -> None:
        self.check_open()
        if self.service.fenced:
            raise HubError(p.Error(code="fenced", message=self.service.fenced))

    def reap(self, call: Callable[[p.Op, float], p.Body]) -> None:
        """The service thread's beat: reap zombies whose reads ended (``Zombies.reap``)."""
        self.zombies.reap(call)

    def await_registered(self, timeout: float) -> None:
        """Returns once the hub took our registration; else ``EndpointError`` after
        ``timeout`` (``HubError`` at once for a refusal no retry changes)."""
        if not self.service.wait_registered(timeout):  # (a bad token raises at once: HubError auth)
            raise EndpointError(f"{self.name}: hub at {self._hub} did not accept our registration "
                                f"within {timeout:.0f}s ({self.service.last_error or 'no answer'})")

    def holdings(self) -> list[p.Holding]:
        """What a (re-)registration carries: every replica, and the reads in flight of
        each, zombies included (contract 3: a restarted hub must pin them again)."""
        out = self.replicas.holdings()
        for extra in self.zombies.holdings():
            have = out.setdefault((extra.model, extra.version), extra)
            if have is not extra and have.rank < 0:  # the failed fetch that left them is still letting go
                known = {r.chunk for r in have.reading}
                have.reading = have.reading + [r for r in extra.reading if r.chunk not in known]
        return list(out.values())

    def filling(self) -> list[p.Filling]:
        """What a beat carries: how far each fetch running here is (``Heartbeat.filling``)."""
        return self.replicas.filling()

    def _asked(self) -> None:
        """A peer asked us something (the peer server's thread): its reads of our memory
        are served at the hot pace from now on; the service thread slows it down again
        once nobody asked for ``hot_s`` (``service``)."""
        if self.engine.needs_progress:
            self.engine.pace(HOT_S)

    def holds_memory(self) -> bool:
        return bool(self.replicas)

    @property
    def registrations(self) -> Registrations:
        """The registration cache (``registrations``): what ``replicas.register`` takes memory from."""
        regs = self.__dict__.get("_registrations")
        if regs is None:  # (an Endpoint assembled without __init__, as tests of its pieces do)
            regs = self.__dict__["_registrations"] = Registrations(self.engine)
        return regs

    # --- the API ---------------------------------------------------------------------

    def publish(self, model: str, version: int, state_dict: dict, shard: Optional[tuple[int, int]] = None,
                *, chunk_bytes: Optional[int] = None, timeout: float = 10.0, ready=None) -> p.Manifest:
        """``ready``: None (the current CUDA stream of the tensors' device is
        synchronized first), or a ``torch.cuda.Event`` (or a list) recorded after the
        last work that writes the tensors, which the host waits for instead (work on
        other streams; an empty list: nothing to wait for). See ``publishing``."""
        self.check_open()
        return publishing.publish(self, model, version, state_dict, shard, chunk_bytes=chunk_bytes,
                                  timeout=timeout, ready=ready)

    def resolve(self, model: str, version: int | str = "latest", *, group: Optional[str] = None,
                timeout: float = 10.0, wait: bool = True) -> p.Resolved:
        """The version ``fetch`` would read (``group`` defaults to the endpoint's own, as
        there), with its manifests; ``timeout`` bounds the whole call, the wait for a
        version not READY yet (``wait``) included, and each round trip is at most
        ``call_timeout_s``. See the module."""
        self.check_open()
        model, number = checks.model(model), checks.version(version, latest=True)
        group, timeout = checks.group(self.info.group if group is None else group), checks.seconds(timeout, "timeout")
        return fetching.resolve(self, model, number, group=group, deadline=time.monotonic() + timeout,
                                each=min(self.call_timeout_s, timeout), wait=wait, timeout=timeout)

    def fetch(self, model: str, version: int | str | p.Resolved = "latest", *, into: dict | Callable,
              group: Optional[str] = None,
              timeout: float = 60.0, wait: bool = True, window: int = 4, read_timeout: Optional[float] = None,
              plan_timeout: Optional[float] = None, resolve_timeout: float = 10.0, collective=None) -> int:
        """``version``: a number, ``"latest"``, or a resolution (``resolve``: not resolved
        again); ``timeout``: the whole fetch, waiting for the version included; ``wait``:
        wait for a version not READY yet (False: ``VersionNotFound`` at once; see
        ``waiting``); ``read_timeout``/``plan_timeout``: one chunk read / plan round
        trip (None: the endpoint's ``read_timeout_s``/``plan_timeout_s``);
        ``resolve_timeout``: one round trip naming the version (at most ``timeout``);
        ``collective``: a torch.distributed process group whose members all call this
        fetch: they read about one copy from holders between them (``collective``).
        On return the bytes are visible on the caller's current CUDA stream: engines
        write outside streams and are done; chunks staged across tensors were scattered
        by async copies, which that stream is made to wait for (no host wait). Work
        still queued that reads or writes ``into`` must be done (or not touch it) before
        the call: engines do not wait for streams."""
        if group is None:  # a member of a model-parallel group resolves with it, whoever calls (contract 2)
            group = self.info.group
        if collective is not None:
            from . import collective as stage  # (torch.distributed only for those who ask)

            return stage.fetch(self, collective, model, version, into=into, group=group, timeout=timeout, wait=wait,
                               window=window, read_timeout=read_timeout, plan_timeout=plan_timeout,
                               resolve_timeout=resolve_timeout)
        self.check_open()
        return fetching.fetch(self, model, version, into=into, group=group, timeout=timeout, wait=wait,
                              window=window, read_timeout=read_timeout, plan_timeout=plan_timeout,
                              resolve_timeout=resolve_timeout)

    def unpublish(self, model: str, version: int, *, timeout: float = 60.0) -> None:
        self.check_open()
        model, version, timeout = checks.model(model), checks.version(version), checks.seconds(timeout, "timeout")
        held = self.replicas.get((model, version))
        if held is None:
            raise EndpointError(f"{self.name} holds no replica of {model}@{version}")
        publishing.unpublish_at_hub(self, model, version, timeout)
        self.replicas.drop(held)

    def verify(self, model: str, version: int, into: dict) -> list[str]:
        """Every way ``into`` differs from the manifest of ``model@version`` as this
        endpoint holds it (empty: byte for byte the version). Re-reads ``into``, which
        must be in the publishers' layout (whole tensors, or their pieces): a
        destination in another layout was verified tile by tile as it was fetched, and
        its bytes cannot be re-hashed against chunks it holds only parts of."""
        self.check_open()
        model, version, into = checks.model(model), checks.version(version), checks.state_dict(into, "into")
        held = self.replicas.get((model, version))
        if held is None:
            raise EndpointError(f"{self.name} holds no replica of {model}@{version}")
        if held.placed.wanted is not None:
            raise BadArgument(f"verify: {self.name} holds {model}@{version} in another layout than its "
                              "publishers'; it was verified tile by tile as it was fetched")
        return verify(held.shards, into)

    def discard(self, model: str, version: int) -> None:
        """Drop our replica of ``model@version`` at once, without a drain: for a version
        the hub already forgot (its ``discard`` command). No-op if we hold none, or only
        a fetch in progress holds it: its reads may still write there (a ``discard``
        runs beside a ``th sync`` fetch), and that fetch lets it go when it fails.
        Its memory is deregistered at once (not kept for reuse: ``registrations``)."""
        held = self.replicas.get((model, version))
        if held is None:
            return
        if not held.complete:
            log.info("%s: discard of %s@%s left to the fetch still filling it", self.name, model, version)
            return
        self.replicas.drop(held, registration="drop")  # (agents free that memory next: no registration outlives it)

    def accept_sync(self, model: str, into: dict | Callable) -> None:
        """Let ``th sync`` make this endpoint fetch ``model`` into ``into`` (a state_dict,
        or a callable that makes one from the manifests). The default command handler
        (``SyncCommands``) and the agent's both fetch into it."""
        self.check_open()
        model, into = checks.model(model), checks.into(into)
        self.sync_into[model] = into

    def report(self, cmd: p.Command, kind: str, message: str = "", *, timeout: Optional[float] = None) -> None:
        """Tell the hub how ``cmd`` went (an event in its log). Best effort, within
        ``timeout`` (None: ``call_timeout_s``): a lost report is logged, not raised."""
        try:
            self.call(p.Report(name=self.name, kind=kind, model=cmd.model, version=cmd.version, message=message),
                      timeout=self.call_timeout_s if timeout is None else timeout)
        except (HubError, HubUnreachable) as exc:
            log.warning("%s: report of %s lost: %s", self.name, kind, exc)

    def versions(self, model: Optional[str] = None, *, timeout: Optional[float] = None) -> list[p.VersionStatus]:
        """The hub's view of ``model``'s versions (None: every model's)."""
        self.check_open()
        model = None if model is None else checks.model(model)
        timeout = checks.optional_seconds(timeout, "timeout")
        return self.call(p.Versions(model=model), self.call_timeout_s if timeout is None else timeout).versions

    def close(self, drain_timeout: float = 30.0) -> None:
        """``drain_timeout``: per replica, for its unpublish, and once more for reads a
        failed fetch left behind (zombies) to stop and be cancelled at the hub before we
        deregister, which drops every pin of ours (0: no drain, just leave)."""
        drain_timeout = checks.seconds(drain_timeout, "drain_timeout", zero=True)
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if drain_timeout and self.service.registered.is_set():
            for held in self.replicas.all():
                try:
                    self.unpublish(held.model, held.version, timeout=drain_timeout)
                except Exception as exc:
                    log.warning("close: %s", exc)
            self.zombies.await_idle(self.call, drain_timeout, lambda: bool(self.service.fenced))
        self.service.stop()
        self._shut = True
        for held in self.replicas.all():
            self.replicas.drop(held)
        self.registrations.close(keep=self.zombies.fenced())  # (leaked, not freed under a read)
        self.peer.close()
        self._sockets.close()
        self.tcp.close()
        self.engine.close()
        self.verifiers.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

