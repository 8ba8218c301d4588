"""A collective stage: the members of a fixed group fetch one version together, reading
about one copy from holders between them (``Endpoint.fetch(..., collective=pg)``).

Protocol. Every member (an ``Endpoint`` in its own process, each a member of the
torch.distributed process group ``pg``) calls ``fetch`` with the same model, version,
group and destination shapes. Stages, each ending in an ``agree`` (``engines.dist``)
so that a member failing on its own fails the others at the same point:

1. ``resolve``: each member resolves the version (with ``group=``, members resolving
   ``latest`` in one round get the same one: contract 2); rank 0's version is then
   everyone's (a member that got another resolves rank 0's by number).
2. ``read``: each member places and registers its destination (as a plain fetch
   does) and reads the chunks it owns from holders through the normal fetch loop,
   planned by the hub, pinned and verified (contracts 3, 5). Owners: with
   **stripes**, chunk ``c`` is member ``c % n``'s (so gather round ``k`` is chunks
   ``k*n .. k*n+n-1``, one per member); with **broadcast**, every chunk is rank 0's.
   A member's stripe is planned by the hub alone (``Plan.want``); fewer chunks than
   members: broadcast.
3. ``gather``: batches of rounds (at most ``gather_bytes`` moved per batch, all
   members together) go over ``pg``: an all-gather, or a broadcast from the one member
   that owns a batch. Each received chunk is verified against the manifest before it
   counts (contract 5), then reported to the hub as held, so the member serves it.
4. ``repair``: a chunk that arrived corrupt is read from holders by its receiver (a
   plain fetch loop: the hub plans only what it does not hold yet); then ``done``.

On return every member holds the whole version in its destination, verified, and is a
complete holder at the hub; ``last_fetch`` says what this member read from holders
(``bytes``: about total/n with stripes) and received from the group (``gathered``),
with seconds per stage. On failure every member raises (``FetchError``; a member whose
own step failed raises that error) and holds no replica in its destination, as with a
plain fetch. A member that dies or hangs fails the others with ``CollectiveError``
naming the stage and the timeout, within the fetch's ``timeout``; the process group is
unusable after that (``engines.dist``).

``measure`` is one collective fetch, timed, for ``scripts/gpu-check``.
"""

from __future__ import annotations

import time
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import torch

from ..engines import dist as coll
from ..errors import EndpointError, FetchError, TensorHubError
from ..hub import protocol as p
from ..hub.client import HubClient
from . import checks, fetching, streams, waiting
from .fetch import Fetch
from .scheduled import ScheduledFetch
from .replica import Replica

GATHER_BYTES = 256 << 20  # per batch, all members together: bounds the gather buffers
REPORT_CHUNKS = 1024  # chunk ids per Progress report


@dataclass(frozen=True)
class Batch:
    parts: tuple[tuple[int, ...], ...]  # per member (group rank): the chunks it sends, in order
    size: int  # bytes each member sends: the largest part (the others are padded)


def owners(nchunks: int, members: int, stripes: bool) -> list[int]:
    """The member that reads each chunk from holders."""
    return [c % members if stripes else 0 for c in range(nchunks)]


def batches(sizes: list[int], owner: list[int], members: int, limit: int) -> list[Batch]:
    """Rounds (each member's next chunk) grouped while every member's part stays within
    ``limit`` bytes (a batch has at least one round)."""
    queues = [[c for c in range(len(sizes)) if owner[c] == m] for m in range(members)]
    depth, k, out = max(map(len, queues)), 0, []
    while k < depth:
        parts: list[list[int]] = [[] for _ in range(members)]
        used = [0] * members
        while k < depth:
            row = [q[k] if k < len(q) else None for q in queues]
            grown = [u + (0 if c is None else sizes[c]) for u, c in zip(used, row)]
            if any(parts) and max(grown) > limit:
                break
            for part, c in zip(parts, row):
                if c is not None:
                    part.append(c)
            used, k = grown, k + 1
        out.append(Batch(tuple(map(tuple, parts)), max(used)))
    return out


class StripeFetch(Fetch):
    """(The windowed loop's; a scheduled member passes ``want`` to ``ScheduledFetch``.)
    The fetch loop over a subset of the version's chunks: every ``Plan`` it sends
    carries ``want`` (a little-endian bitmask), so the hub plans, pins and counts only
    those, and answers ``complete`` once we hold them."""

    def __init__(self, *args, want: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.want = sum(1 << c for c in want).to_bytes((max(want, default=0) >> 3) + 1, "little")

    def run(self) -> None:
        self.client = _Wanting(self.ep.hub_client(), self.want)
        try:
            self._loop()
        finally:
            self.client.close()


class _Wanting:
    """A hub socket that adds our subset to each ``Plan`` sent through it (a plan sent
    again after a timeout, too)."""

    def __init__(self, client: HubClient, want: bytes):
        self._client, self._want = client, want

    def send(self, op: p.Op) -> int:
        if isinstance(op, p.Plan):
            op = msgspec.structs.replace(op, want=self._want)
        return self._client.send(op)

    def __getattr__(self, name: str):
        return getattr(self._client, name)


@dataclass
class Member:
    """This member's side of one collective fetch."""

    ep: object
    comm: coll.Collective
    held: Optional[Replica] = None
    fresh: bool = False  # registered by this fetch (a failure drops it)
    have: set[int] = field(default_factory=set)  # chunks verified in our memory
    job: Optional[Fetch] = None
    votes: list[tuple[bool, int]] = field(default_factory=list)  # the last agreement's
    report_error: Optional[BaseException] = None  # a report of gathered chunks the hub did not take
    stats: dict = field(default_factory=lambda: {"bytes": 0, "reads": 0, "corrupt": 0, "failed": 0,
                                                 "from_publishers": 0, "gathered": 0})
    seconds: dict = field(default_factory=dict)


def fetch(ep, pg, model: str, version: int | str = "latest", *, into, group: Optional[str] = None,
          timeout: float = 60.0, wait: bool = True, window: int = 4, read_timeout: Optional[float] = None,
          plan_timeout: Optional[float] = None, resolve_timeout: float = 10.0,
          gather_bytes: int = GATHER_BYTES) -> int:
    """``Endpoint.fetch(..., collective=pg)``: the arguments are ``Endpoint.fetch``'s."""
    ep.check_open()
    model, number, given, into, group, timeout, window, read_timeout, plan_timeout, resolve_timeout = \
        checks.fetch_args(model, version, into, group, timeout, window, read_timeout, plan_timeout, resolve_timeout)
    gather_bytes = checks.count(gather_bytes, "gather_bytes")
    pg = coll.check_group(pg)
    if coll.dist.get_world_size(pg) == 1:
        return ep.fetch(model, version, into=into, group=group, timeout=timeout, wait=wait, window=window,
                        read_timeout=read_timeout, plan_timeout=plan_timeout, resolve_timeout=resolve_timeout)
    began = time.monotonic()
    deadline = began + timeout
    what = f"{model}@{'latest' if number is None else number} in group {group or '-'}"
    comm = coll.Collective(pg, deadline=deadline, timeout=timeout, what=what, device=_control_device(pg, into))
    me = Member(ep, comm)
    try:
        resolved = _stage(me, "resolve", lambda: given or waiting.resolve(
            ep.call, p.Resolve(name=ep.name, model=model, version=number, group=group), deadline=deadline,
            each=min(resolve_timeout, timeout), wait=bool(wait), timeout=timeout))
        number = me.votes[0][1]  # rank 0's version is everyone's
        comm.what = f"{model}@{number} in group {group or '-'}"

        def read() -> None:
            nonlocal resolved
            if resolved.version != number:  # (no group round tied us to rank 0's)
                resolved = waiting.resolve(ep.call, p.Resolve(name=ep.name, model=model, version=number),
                                           deadline=deadline, each=min(resolve_timeout, timeout), wait=False,
                                           timeout=timeout)
            _read(me, resolved, into, deadline, window, read_timeout, plan_timeout)

        _stage(me, "read", read)

        def gather_and_repair() -> None:
            bad = _gather(me, gather_bytes)
            if bad:  # contract 5: what the group handed us corrupt is read again from holders
                _run(me, Fetch(ep, me.held, deadline, window, **_timeouts(ep, read_timeout, plan_timeout)))
            if me.report_error is not None:
                raise me.report_error

        _stage(me, "gather", gather_and_repair)
    except BaseException:  # (a broken group, an interrupt; our own stage's failure gave up already)
        _give_up(me)
        raise
    streams.reached(me.held.placed.device, me.held.written)  # stream order, as Endpoint.fetch
    ep.last_fetch = {**me.stats, "collective": "stripes" if _stripes(me) else "broadcast", "members": comm.size,
                     "rank": comm.rank, "seconds": me.seconds}
    return number


def measure(ep, pg, model: str, version: int | str, into: dict, *, group: Optional[str] = None,
            timeout: float = 60.0) -> dict:
    """One collective fetch into ``into`` (every member of ``pg`` calls it), timed: what
    a GPU check prints per member (``scripts/gpu-check``, NCCL with CUDA ``into``):
    ``last_fetch`` plus ``version``, ``bytes_total`` (of ``into``), ``wall_s`` and
    ``gb_per_s``. Raises as ``fetch`` does."""
    began = time.monotonic()
    got = fetch(ep, pg, model, version, into=into, group=group, timeout=timeout)
    wall_s = time.monotonic() - began
    nbytes = sum(t.nbytes for t in into.values())
    return {**ep.last_fetch, "version": got, "bytes_total": nbytes, "wall_s": wall_s,
            "gb_per_s": nbytes / wall_s / 1e9}


def _control_device(pg, into) -> torch.device:
    tensors = [t for t in into.values() if isinstance(t, torch.Tensor)] if isinstance(into, dict) else []
    want = tensors[0].device if tensors else torch.device("cpu")
    return coll.backend_device(pg, want)


def _stripes(me: Member) -> bool:
    return len(me.held.placed.views) >= me.comm.size


def _read(me: Member, resolved: p.Resolved, into, deadline: float, window: int,
          read_timeout: Optional[float], plan_timeout: Optional[float]) -> None:
    """Register the destination (or take the replica we hold already), then read the
    chunks we own that we do not hold."""
    ep = me.ep
    key = (resolved.model, resolved.version)
    held = ep.replicas.get(key)
    if held is not None and held.rank >= 0 and held.world > 1:
        raise EndpointError(f"{ep.name} publishes shard {held.rank} of {held.world} of {key[0]}@{key[1]}, and an "
                            "endpoint holds one replica of a version: fetch the whole version on an endpoint of "
                            "its own (connect with another name)")
    if held is not None:
        complete = (held.rank >= 0 and held.world == 1) or len(held.held) == len(held.placed.views)
        if not complete or (not callable(into) and not {t.data_ptr() for t in into.values() if t.nbytes}
                            <= {r.addr for r in held.placed.regions}):
            raise EndpointError(f"{ep.name} already holds {key[0]}@{key[1]} in other memory (or is still "
                                "fetching it); unpublish it first")
        me.held, me.have = held, set(range(len(held.placed.views)))
        return
    me.held = fetching.set_up(ep, resolved, into, deadline, whole=True)  # (members share whole chunks)
    me.fresh = True
    placed = me.held.placed
    owner = owners(len(placed.views), me.comm.size, _stripes(me))
    mine = [c for c, o in enumerate(owner) if o == me.comm.rank]
    options = _timeouts(ep, read_timeout, plan_timeout)
    if getattr(ep, "schedule", True):  # the reader core, on our stripe or the whole version
        job = ScheduledFetch(ep, me.held, deadline, window, want=mine if _stripes(me) else None, **options)
    elif _stripes(me):
        job = StripeFetch(ep, me.held, deadline, window, want=mine, **options)
    else:
        job = Fetch(ep, me.held, deadline, window, **options)
    me.job = job
    if mine:
        _run(me, job)


def _timeouts(ep, read_timeout: Optional[float], plan_timeout: Optional[float]) -> dict:
    return dict(read_timeout=ep.read_timeout_s if read_timeout is None else read_timeout,
                plan_timeout=ep.plan_timeout_s if plan_timeout is None else plan_timeout,
                describe_timeout=ep.call_timeout_s)


def _run(me: Member, job: Fetch) -> None:
    me.job = job
    job.run()
    for k in ("bytes", "reads", "corrupt", "failed", "from_publishers"):
        me.stats[k] += job.stats[k]
    with me.held.lock:
        me.have |= me.held.held


def _gather(me: Member, gather_bytes: int) -> list[int]:
    """Every batch over the group; returns the chunks that arrived corrupt. Every
    member makes the same collective calls whatever happens to it: a failure of its
    own work between them (packing, copying, hashing) is kept and raised once the last
    batch is through, so no member reaches the stage's ``agree`` while the others are
    still in a batch (mismatched collectives are undefined with NCCL)."""
    comm, held = me.comm, me.held
    views = held.placed.views
    sizes = [v.nbytes for v in views]
    owner = owners(len(views), comm.size, _stripes(me))
    limit = max(max(sizes), gather_bytes // comm.size)
    checking: dict[int, object] = {}
    bad: list[int] = []
    failed: Optional[Exception] = None
    for batch in batches(sizes, owner, comm.size, limit):
        senders = [m for m, part in enumerate(batch.parts) if part]
        buf = torch.empty(batch.size, dtype=torch.uint8, device=comm.device)
        if failed is None:
            try:
                _pack(buf, [views[c] for c in batch.parts[comm.rank]])
            except Exception as exc:  # (what we send no longer matters: we fail at the stage's end)
                failed = exc
        if len(senders) == 1:
            comm.broadcast("gather", buf, senders[0])
            got = {senders[0]: buf}
        else:
            got = dict(enumerate(comm.all_gather("gather", buf)))
        if failed is None:
            try:
                _take(me, batch, got, sizes, checking, bad)
            except Exception as exc:
                failed = exc
    if failed is not None:
        raise failed
    _collect_checks(me, checking, bad, block=True)
    return bad


def _take(me: Member, batch: Batch, got: dict, sizes: list[int], checking: dict, bad: list[int]) -> None:
    """Copy what the others sent into our destination, then hash it (on the verifier
    threads, once the copies are done on the destination's device: a callable ``into``
    may have made CUDA tensors under a gloo group, whose buffers are on the host)."""
    views, received = me.held.placed.views, []
    for m, part in enumerate(batch.parts):
        at = 0
        for c in part:
            if m != me.comm.rank and c not in me.have:
                views[c].copy_(got[m][at:at + sizes[c]])
                received.append(c)
            at += sizes[c]
    device = me.comm.device
    streams.caught_up({me.held.placed.device, (device.index or 0) if device.type == "cuda" else -1}, None)
    for c in received:
        checking[c] = me.ep.verifiers.submit(me.held.placed.checksum, c)
    _collect_checks(me, checking, bad, block=False)


def _pack(buf: torch.Tensor, views: list) -> None:
    at = 0
    for v in views:
        buf[at:at + v.nbytes].copy_(v)
        at += v.nbytes


def _collect_checks(me: Member, checking: dict, bad: list[int], *, block: bool) -> None:
    """Chunks whose checksum is in: the good ones become held (scattered into their
    tensors, then reported to the hub), the others go to ``bad``."""
    if block and checking:
        wait_futures(list(checking.values()), timeout=max(0.0, me.comm.deadline - time.monotonic()))
    good = []
    for c, digest in list(checking.items()):
        if not digest.done():
            if block:
                raise FetchError(f"checksums of {len(checking)} gathered chunk(s) not done within the timeout")
            continue
        del checking[c]
        try:
            ok = digest.result() == me.held.expected(c).checksum
        except Exception:  # (a checksum that could not be computed proves nothing: read it again)
            ok = False
        if not ok:
            me.stats["corrupt"] += 1
            bad.append(c)
            continue
        if me.held.placed.finish(c):  # async copies: the caller's stream waits for the last one
            me.held.written = streams.scattered(me.held.placed.device)
        me.held.mark_held([c])  # (readers waiting on us for it hear so)
        me.have.add(c)
        me.stats["gathered"] += me.held.placed.views[c].nbytes
        good.append(c)
    for at in range(0, len(good), REPORT_CHUNKS):
        try:
            me.ep.call(p.Progress(name=me.ep.name, model=me.held.model, version=me.held.version,
                                  chunks=good[at:at + REPORT_CHUNKS], incarnation=me.ep.incarnation),
                       timeout=me.ep.call_timeout_s)
        except TensorHubError as exc:  # (raised at the stage's end: the group's collectives go on meanwhile)
            me.report_error = me.report_error or exc


def _stage(me: Member, stage: str, work):
    """Run our part of ``stage``, then agree on its outcome: go on if every member
    succeeded; else let our replica go and raise our own error, or one naming the
    members that failed. A ``CollectiveError`` ends it at once (the group is broken)."""
    began, err, result = time.monotonic(), None, None
    try:
        result = work()
    except coll.CollectiveError:
        raise
    except Exception as exc:
        err = exc
    me.votes = me.comm.agree(stage, err is None, result.version if isinstance(result, p.Resolved) else 0)
    me.seconds[stage] = time.monotonic() - began
    failed = [m for m, (ok, _) in enumerate(me.votes) if not ok]
    if failed:
        _give_up(me)
        if err is not None:
            raise err
        raise FetchError(f"{me.ep.name}: collective fetch of {me.comm.what} failed: member(s) {failed} of "
                         f"{me.comm.size} failed at stage {stage!r}; the destination holds no version")
    return result


def _give_up(me: Member) -> None:
    """A failed collective fetch leaves no replica this fetch registered (as
    ``fetching.abort`` does for a plain one)."""
    if me.fresh and me.held is not None:
        job = me.job or Fetch(me.ep, me.held, me.comm.deadline, 1, read_timeout=1.0, plan_timeout=1.0,
                              describe_timeout=1.0)
        fetching.abort(me.ep, job, me.held)
        me.fresh = False
