"""``connect``: join a cluster by its hub's address, or by the name ``th up`` gave it.

Protocol. ``connect(hub="tcp://HOST:PORT", token=..., name=..., ...)`` is
``endpoint.connect`` itself. ``connect(cluster=NAME, node=..., name=..., ...)`` first
looks the cluster up (``launch.lookup``): the hub address, token and the node's place
(address, rack, DC) always come from the cluster; the engine, ``heartbeat_s`` and the
endpoint timeouts come from it unless the caller passes them. Either way it returns a
registered ``Endpoint``. Inside a Ray worker, on a cluster started with ``launcher:
ray``, ``connect(name=...)`` alone finds the cluster, its node and the token through
Ray (``launch.ray_lookup``). Either way it raises ``BadArgument`` (an argument is wrong; it is named),
``EndpointError`` (the cluster cannot be looked up, or the hub did not accept the
registration in time) or ``HubError`` (the hub refused us for good: ``auth``, a bad
token, at once).

Imports are deferred to the call: ``import tensorhub_cli`` (every ``th`` command)
must not pay for the endpoint stack.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

from .errors import BadArgument, EndpointError

_HOST = "127.0.0.1"  # what an endpoint binds when given no host (endpoint.connect)
_CALLER_WINS = ("engine", "heartbeat_s", "read_timeout_s", "plan_timeout_s", "drain_timeout_s")


def connect(hub: Optional[str] = None, token: Optional[str] = None, *, cluster: Optional[str] = None,
            name: str, node: Optional[str] = None, role: str = "", reliable: bool = True,
            group: Optional[str] = None, tier: Optional[Literal["device", "host"]] = None, device: object = None,
            kind: Literal["endpoint", "agent"] = "endpoint", engine: Optional[Literal["nixl", "tcp"]] = None,
            host: Optional[str] = None, dc: str = "", rack: str = "", heartbeat_s: Optional[float] = None,
            read_timeout_s: Optional[float] = None, plan_timeout_s: Optional[float] = None,
            drain_timeout_s: Optional[float] = None, call_timeout_s: Optional[float] = None,
            connect_timeout: Optional[float] = None, on_command: Optional[Callable] = None,
            chunk_bytes: Optional[int] = None, small_bytes: Optional[int] = None,
            peer_idle_s: Optional[float] = None, conn_idle_s: Optional[float] = None,
            reg_cache_bytes: Optional[int] = None, metrics_port: Optional[int] = None,
            schedule: Optional[bool] = None):
    """Join a TensorHub cluster as endpoint ``name``; returns a registered ``Endpoint``
    (``publish``, ``fetch``, ``unpublish``, ``versions``, ``close``; a context manager).

    Where the hub is (exactly one of the two):
      hub: the hub's address, "tcp://HOST:PORT"; needs ``token``.
      token: the cluster token (``th up`` writes it under $TH_HOME).
      cluster: the name of a cluster ``th up`` started on this machine; the hub, the
        token and the place of ``node`` (address, rack, DC) are read from it.
      Inside a Ray worker, on a cluster ``th up`` started with ``launcher: ray``:
        ``cluster`` may be left out too (the Ray cluster's one TensorHub cluster),
        and ``node`` (the TensorHub node of the Ray node we run on): no environment
        variables needed (``launch.ray_lookup``).

    Who we are:
      name: this endpoint's name, unique in the cluster (a process restarted under it
        replaces the old one).
      node: the node we run on (required with ``cluster``, except inside a Ray
        worker; default "local").
      role: free text shown by ``th status`` and matched by ``th sync --role``.
      reliable: True counts our copies towards retention (``min_reliable_copies``);
        False for spot workers.
      group: the model-parallel group we resolve ``latest`` with (contract 2).
      device: where the tensors we publish and fetch live: "cpu" (default), "cuda:N",
        N or a ``torch.device``; the engine reads and serves that device's memory.
      tier: "host" (CPU memory) or "device" (GPU memory), what the hub counts our
        copies as; None (default) follows ``device``; a contradiction is BadArgument.
      kind: "endpoint", or "agent" (the per-node daemon; not for applications).
      engine: "nixl" (default; falls back to "tcp" with a warning) or "tcp".
      host, dc, rack: the address we bind and send from (default 127.0.0.1) and our
        place in the topology (ignored with ``cluster``: the cluster's).

    Timeouts in seconds, sizes in bytes (None: the cluster's where it sets one, else
    the default shown):
      heartbeat_s: heartbeat period (1.0).
      read_timeout_s: one chunk read before it is re-planned (30.0).
      plan_timeout_s: one plan round trip to the hub (5.0).
      drain_timeout_s: what a leaving agent grants each replica's drain, and a failed
        fetch its partial replica's withdrawal (120.0).
      call_timeout_s: any other hub or peer round trip (5.0).
      connect_timeout: until the hub accepts our registration (10.0).
      peer_idle_s: our peer server closes a reader's idle connection (300.0).
      conn_idle_s: our tcp engine reuses a pooled connection idle at most this (60.0).
      chunk_bytes, small_bytes: chunk size of what we publish (16 MiB), and the size
        below which tensors are packed together (1 MiB).
      reg_cache_bytes: engine registrations kept for reuse once no version uses them
        (256 GiB; 0 turns the cache off): memory published or fetched into again, as
        an in-place trainer's parameters, is registered once.
      schedule: fetch by a schedule the hub makes once per fetch (True, the default
        unless ``$TH_FETCH`` is "window"), or by a window of reads planned at a time
        (False: the older loop).

    Metrics:
      metrics_port: serve this process's fetch histograms (per-stage seconds, bytes:
        ``endpoint.metrics``) on ``/metrics`` at this port (0: any free one) of our
        address (``host``, or the node's with ``cluster``; never every interface: the
        listener has no authentication); None (default): ``$TH_METRICS_PORT`` if set,
        else not served.

    Hooks:
      on_command: ``handler(endpoint, command)`` for commands the hub pushes (default:
        ``SyncCommands``, serving ``th sync`` into what ``accept_sync`` named).

    Raises ``BadArgument`` naming a bad argument; ``EndpointError`` when the cluster
    cannot be looked up or the hub does not accept the registration in time;
    ``HubError`` (code ``auth``) at once when the hub refuses our token.
    """
    from . import endpoint as endpoint_lib  # (deferred: see the module)

    from .launch.ray_lookup import in_ray

    if hub is not None and cluster is not None:
        raise BadArgument("connect needs exactly one of hub=... or cluster=...")
    if hub is None and cluster is None and not in_ray():
        raise BadArgument("connect needs exactly one of hub=... or cluster=... (neither only inside a Ray worker "
                          "of a cluster `th up` started with launcher: ray)")
    given = dict(name=name, node=node, role=role, reliable=reliable, group=group, tier=tier, device=device, kind=kind,
                 engine=engine, host=host, dc=dc, rack=rack, heartbeat_s=heartbeat_s, read_timeout_s=read_timeout_s,
                 plan_timeout_s=plan_timeout_s, drain_timeout_s=drain_timeout_s, call_timeout_s=call_timeout_s,
                 connect_timeout=connect_timeout, on_command=on_command, chunk_bytes=chunk_bytes,
                 small_bytes=small_bytes, peer_idle_s=peer_idle_s, conn_idle_s=conn_idle_s,
                 reg_cache_bytes=reg_cache_bytes, schedule=schedule)
    options = {k: v for k, v in given.items() if v is not None}
    if hub is None:
        from .launch.lookup import endpoint_options

        if cluster is not None and (not isinstance(cluster, str) or not cluster):
            raise BadArgument(f"cluster takes a cluster's name (a non-empty str), not {cluster!r}")
        try:
            found = endpoint_options(cluster, node)
        except LookupError as exc:
            raise EndpointError(str(exc)) from None
        for key in _CALLER_WINS:
            if key in options:
                found.pop(key, None)
        options.update(found)
        _serve_metrics(metrics_port, options.get("host") or _HOST)
        return endpoint_lib.connect(**options)
    _serve_metrics(metrics_port, options.get("host") or _HOST)
    return endpoint_lib.connect(hub=hub, token=token, **options)


def _serve_metrics(port: Optional[int], host: str = _HOST) -> None:
    """Opt-in: serve the fetch histograms on ``host`` (the node's address, as the hub's
    metrics) when ``port`` or ``$TH_METRICS_PORT`` says so; else nothing listens."""
    import os

    if not isinstance(host, str) or not host:
        raise BadArgument(f"host takes an address (a non-empty str), not {host!r}")
    if port is None:
        raw = os.environ.get("TH_METRICS_PORT", "")
        if not raw:
            return
        try:
            port = int(raw)
        except ValueError:
            raise BadArgument(f"TH_METRICS_PORT takes a port number, not {raw!r}") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise BadArgument(f"metrics_port takes a port number 0..65535, not {port!r}")
    from .endpoint import metrics

    try:
        metrics.serve(port, host)
    except OSError as exc:
        raise BadArgument(f"metrics_port {port}: cannot serve /metrics there ({exc.strerror or exc})") from None
