"""The operator's messages on the hub's wire (``hub/protocol.py`` frames them): what
``th`` asks of the hub (``Status``, ``Versions``, ``Events``, ``Sync``, ``Load``,
``Note``, ``Withdraw``), the ``Command``s the hub sends endpoints on its behalf, the
``Report``s endpoints send back, and the replies. Split from the data path's messages
(register, publish, resolve, plan, progress), which are what the hub does per read.
"""

from __future__ import annotations

from typing import Literal, Optional

from .msg import Msg


class Status(Msg, tag="status"):
    pass


class Sync(Msg, tag="sync"):
    """Have the endpoints of ``role`` (or on ``node``) fetch ``model@version`` (None:
    latest READY, resolved once here so every target fetches the same one)."""

    model: str
    version: Optional[int] = None
    role: Optional[str] = None
    node: Optional[str] = None


class Load(Msg, tag="load"):
    """Have ``node``'s agent load a safetensors file, or a Hugging Face checkpoint
    directory (sharded by its index), at ``path`` on that node into host memory and
    publish it as ``model@version``."""

    node: str
    model: str
    version: int
    path: str
    chunk_bytes: int = 0  # 0: the agent's default


class Report(Msg, tag="report"):
    """An endpoint tells the hub what happened to a command (kept as an event)."""

    name: str
    kind: str  # fetched, fetch_failed, loaded, load_failed, retained, retain_failed
    model: str
    version: int
    message: str = ""


class Versions(Msg, tag="versions"):
    model: Optional[str] = None


class Note(Msg, tag="note"):
    """An operator command (``th scale``, ``th failover``) records what it did, so the
    hub's event log (``th status``) tells the whole story, not only the endpoints' part."""

    kind: str  # scaled, failed_over
    message: str
    endpoint: str = ""


class Events(Msg, tag="events"):
    """The hub's events with ``seq`` greater than ``since``, oldest first (of the last
    ``EVENTS_KEPT``): what a command following its outcomes polls, so none is missed."""

    since: int = 0


class Withdraw(Msg, tag="withdraw"):
    """An operator withdraws ``model@version`` (``th unpublish``): every replica of it,
    or only those of endpoints on ``node``. Each is drained at once (no new reads; the
    reads in flight finish first, contract 3) and its holder is sent an ``unpublish``
    command to let its memory go. Answered, deferred, with ``Withdrawn`` once none of
    those replicas is left, or ``Error(timeout)`` naming who still holds it after
    ``timeout_s``. Without ``node`` the version itself is withdrawn: retention makes no
    copy of it and holds no last copy back (contract 4 no longer covers it); with
    ``node`` the version stays published elsewhere and retention still applies, its
    copies made off that node."""

    model: str
    version: int
    node: str = ""
    timeout_s: float = 60.0


class Command(Msg, tag="command"):
    """Hub → endpoint. ``retain`` (to an agent): pull ``model@version`` into host memory
    and hold it. ``fetch``: fetch it (``th sync``). ``load`` (to an agent): load the
    safetensors file at ``path`` and publish it as ``model@version`` (``th publish``).
    ``discard`` (to an agent): the hub forgot that version; free the copy of it.
    ``unpublish`` (``th unpublish``, to any holder): the hub withdrew that version from
    us (our replica drains there already); unpublish it to let the memory go.
    ``replan`` (to a reader): the hub dropped a source of our reads of that version
    (expired, left, restarted): ask for a new plan now (the endpoint acts on it itself,
    no handler sees it)."""

    action: Literal["retain", "fetch", "load", "discard", "unpublish", "replan"]
    model: str
    version: int
    path: str = ""
    chunk_bytes: int = 0


class Synced(Msg, tag="synced"):
    version: int
    targets: list[str]


class Event(Msg):
    seq: int
    t: float  # hub uptime, seconds
    kind: str
    endpoint: str = ""
    model: str = ""
    version: int = 0
    message: str = ""


class EndpointStatus(Msg):
    name: str
    node: str
    role: str
    kind: str
    alive: bool
    heartbeat_age_s: float
    replicas: int
    rack: str = ""
    dc: str = ""
    reliable: bool = True
    pid: int = 0  # which process holds the name (scale and reconcile check it is theirs)
    # Bytes of reads the hub planned for this endpoint since it registered, and how
    # many of them from publishers (a trainer's send counter, per reader).
    bytes_planned: int = 0
    bytes_from_publishers: int = 0


class HolderStatus(Msg):
    name: str
    held_bytes: int
    complete: bool
    reliable: bool
    draining: bool = False


class VersionStatus(Msg):
    model: str
    version: int
    state: str
    chunks: int
    nbytes: int
    replicas: int
    complete_replicas: int
    reliable_copies: int = 0
    holders: list[HolderStatus] = []


class StatusReply(Msg, tag="status"):
    cluster: str
    uptime_s: float
    endpoints: list[EndpointStatus]
    versions: list[VersionStatus]
    counters: dict[str, float]
    events: list[Event] = []


class VersionsReply(Msg, tag="versions"):
    versions: list[VersionStatus]


class EventsReply(Msg, tag="events"):
    events: list[Event]
    # The oldest seq still kept: above ``since + 1``, events were lost to the bound.
    first_seq: int = 0
    # The newest seq: below ``since``, the hub restarted (its seqs began again at 1).
    last_seq: int = 0


class Withdrawn(Msg, tag="withdrawn"):
    """A ``Withdraw`` is done: ``endpoints`` let their replicas go (drained)."""

    model: str
    version: int
    endpoints: list[str] = []
