"""The agent's host-tier copies in files, so that a ``kill -9`` does not lose them.

Protocol. An agent's copies live under its own directory,
``<base>/<cluster or hub-PORT>/<agent name>/`` (``agent_dir``; base: ``--store`` or
``$TH_AGENT_STORE``, else ``/dev/shm/tensorhub``, else a temp directory, with a
warning, where /dev/shm is missing), which exists only while it holds a copy.
``Store.open`` claims it for the process's life by binding an abstract unix socket
named after it: a second live agent on the same directory is refused, naming the
first's pid (its start would delete copies the first is filling); the kernel frees
the name when the holder dies, even by ``kill -9``, and it leaves no file behind.

One directory per ``model@version`` (the model name percent-quoted), written in this
order, so that a copy is adopted only when every step happened:

1. ``manifest``: a msgpack ``Record``: the version's shards exactly as the endpoint
   holds them (chunking and checksums), where each tensor lies in ``data``, and the
   cluster's token fingerprint. Written to a temp name, then renamed.
2. ``data``: every tensor's bytes, one file mapped shared (``torch.from_file``), space
   reserved up front (a full tmpfs is an error here, not a SIGBUS mid-fetch). The
   tensors ``allocate`` returns *are* that mapping: the endpoint registers and serves
   them, there is no second copy (but for the staging buffer of chunks that span small
   tensors, which ``place`` makes).
3. ``complete``: written (temp name, then rename) by ``complete`` once the fetch
   verified every chunk, or a ``load`` was published.

``recover`` (at agent start, before registering) deletes every directory without
``complete`` and every copy that is unreadable, from another cluster (token
fingerprint) or whose bytes do not match its manifest chunk for chunk; it returns the
others as ``Copy``s, each placed and verified, ready to be registered as held. Each
re-adopted and each dropped copy is logged by name. ``remove`` deletes one copy (a
``discard``), ``clear`` all of them and the directory (a clean exit).

Threads: the agent's two command workers and its main thread call in; the set of
copies in use is kept under a lock, so two fetches of one version never share (or
delete) each other's files.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import msgspec

from ..hub import protocol as p
from ..layout import LayoutError, Placed, place
from ..layout.placement import piece_keys

log = logging.getLogger("tensorhub.agent")
DEFAULT_BASE = Path("/dev/shm/tensorhub")
ALIGN = 64  # every tensor starts here in ``data``: any dtype's element alignment


class StoreError(Exception):
    """The store cannot hold a copy (full, unwritable, in use); nothing was kept."""


class Slot(msgspec.Struct):
    name: str
    dtype: str
    shape: list[int]
    offset: int  # in ``data``
    nbytes: int


class Record(msgspec.Struct):
    model: str
    version: int
    world: int
    rank: int  # -1: a reader's copy (every shard); 0: a version the agent published (``load``)
    shards: list[p.Manifest]  # empty until a ``load`` is published
    slots: list[Slot]
    nbytes: int
    cluster: str  # token fingerprint: a copy from another cluster is never offered


@dataclass(eq=False)  # (identity: tensors have no truth value)
class Copy:
    """A verified surviving copy: ``placed`` over ``tensors`` (the mapping), every chunk checked."""

    model: str
    version: int
    world: int
    rank: int
    shards: list[p.Manifest]
    placed: Placed
    tensors: dict


def fingerprint(token: str) -> str:
    return hashlib.blake2b(token.encode(), digest_size=8, person=b"th-store").hexdigest()


def agent_dir(name: str, hub: str, cluster: str | None = None, base: str | None = None) -> Path:
    """Where agent ``name``'s copies live (module docstring)."""
    base = base or os.environ.get("TH_AGENT_STORE") or None
    if base is None:
        if DEFAULT_BASE.parent.is_dir():
            root = DEFAULT_BASE
        else:
            root = Path(tempfile.gettempdir()) / "tensorhub-store"
            log.warning("/dev/shm is missing: copies live in %s (not tmpfs: slower, and on disk)", root)
    else:
        root = Path(base)
    if cluster:
        key = cluster
    else:
        port = urlsplit(hub).port
        if port is None:
            raise StoreError(f"hub address {hub!r} has no port to name the store by; pass --cluster or --store")
        key = f"hub-{port}"
    for part, what in ((key, "cluster"), (name, "agent name")):
        if not part or "/" in part or part in (".", ".."):
            raise StoreError(f"{what} {part!r} cannot name a store directory")
    return root / key / name


def _owner(name: str) -> int | None:
    """The pid bound to our store's name (its peer credentials), if it answers at once."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(f"\0tensorhub-store-{name}")
            return struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            return None


def _key(model: str, version: int) -> str:
    return f"{quote(model, safe='')}@{version}"


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: a crash leaves the old file or none, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class Store:
    def __init__(self, root: Path, token: str):
        self.root = Path(root)
        self.cluster = fingerprint(token)
        self._lock = threading.Lock()
        self._live: set[tuple[str, int]] = set()  # copies this process made or adopted
        self._claimed: socket.socket | None = None

    @classmethod
    def open(cls, root: Path, token: str) -> "Store":
        store = cls(root, token)
        store._claim()
        return store

    def _claim(self) -> None:
        """Bind an abstract unix socket named after our directory: the kernel frees the
        name when we die (even by kill -9), and an agent holding no copy leaves no file."""
        name = hashlib.blake2b(str(self.root.resolve()).encode(), digest_size=12).hexdigest()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(f"\0tensorhub-store-{name}")
            sock.listen(1)
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise StoreError(f"agent store {self.root}: cannot claim it ({exc.strerror})") from None
            raise StoreError(f"agent store {self.root} is in use by another live agent "
                             f"(pid {_owner(name) or '?'})") from None
        self._claimed = sock

    def close(self) -> None:
        """Let go of the directory (the copies stay: ``clear`` first to delete them)."""
        if self._claimed is not None:
            self._claimed.close()
            self._claimed = None

    def path(self, model: str, version: int) -> Path:
        return self.root / _key(model, version)

    # --- making copies ---------------------------------------------------------------

    def allocate(self, model: str, version: int, shards: list[p.Manifest]) -> dict:
        """Fresh tensors for a reader's copy of every shard in ``shards``, mapped from
        the store; the manifest is on disk before they are returned."""
        keys = piece_keys(shards)  # (the publishers' layout: chunks are copied as they are)
        specs = {keys[id(t)]: (t.dtype, list(t.shape)) for m in shards for t in m.tensors}
        return self._make(model, version, len(shards), -1, shards, specs)

    def allocate_like(self, model: str, version: int, state_dict: dict) -> dict:
        """Fresh store tensors shaped as ``state_dict`` (a checkpoint to load and publish
        as shard 0 of 1); its manifest comes with ``complete``."""
        from ..layout import dtype_name

        specs = {n: (dtype_name(t), list(t.shape)) for n, t in state_dict.items()}
        return self._make(model, version, 1, 0, [], specs)

    def _make(self, model: str, version: int, world: int, rank: int, shards: list, specs: dict) -> dict:
        import torch

        slots, at = [], 0
        for name, (dtype, shape) in specs.items():
            try:
                size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            except (AttributeError, TypeError):
                raise LayoutError("cannot store this version", [f"{name}: unknown dtype {dtype!r}"]) from None
            nbytes = size
            for n in shape:
                nbytes *= n
            slots.append(Slot(name=name, dtype=dtype, shape=shape, offset=at, nbytes=nbytes))
            at += -(-nbytes // ALIGN) * ALIGN
        key, d = (model, version), self.path(model, version)
        with self._lock:
            if key in self._live:
                raise StoreError(f"{model}@{version} is already in the agent store {self.root} (being fetched?)")
            self._live.add(key)
        try:
            shutil.rmtree(d, ignore_errors=True)  # a stale copy nobody adopted: never ours to keep
            with self._lock:  # (a ``remove`` prunes our directory once empty: not between these two)
                self._mkroot()
                d.mkdir(mode=0o700)
            record = Record(model=model, version=version, world=world, rank=rank, shards=shards, slots=slots,
                            nbytes=at, cluster=self.cluster)
            _write(d / "manifest", msgspec.msgpack.encode(record))
            data = self._map(d / "data", at, reserve=True)
            return {s.name: data[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
                    for s in slots}
        except BaseException as exc:
            self._forget(model, version)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot store {model}@{version} ({at} bytes) in {d}: {exc}") from None
            raise

    def _mkroot(self) -> None:
        for attempt in range(3):  # (another agent's clean exit may remove an empty parent under us)
            try:
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
                return
            except FileNotFoundError:
                continue
        raise FileNotFoundError(f"{self.root}: its parent keeps disappearing")

    @staticmethod
    def _map(path: Path, nbytes: int, reserve: bool = False):
        import torch

        if reserve:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if nbytes:
                    os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)

    def complete(self, model: str, version: int, shards: list[p.Manifest] | None = None) -> None:
        """Every chunk is in and verified (or, with ``shards``, the loaded version was
        published with that manifest): from now on the copy survives a restart."""
        d = self.path(model, version)
        with self._lock:  # (small writes: a ``remove`` meanwhile waits, then deletes them too)
            if (model, version) not in self._live:  # a discard removed it meanwhile: not ours to keep
                log.warning("%s@%s was removed from the store while being made; not kept", model, version)
                return
            if shards is not None:
                record = msgspec.msgpack.decode((d / "manifest").read_bytes(), type=Record)
                _write(d / "manifest", msgspec.msgpack.encode(msgspec.structs.replace(record, shards=shards)))
            _write(d / "complete", b"")

    # --- letting copies go -----------------------------------------------------------

    def _forget(self, model: str, version: int) -> None:
        with self._lock:
            self._live.discard((model, version))
        shutil.rmtree(self.path(model, version), ignore_errors=True)

    def remove(self, model: str, version: int) -> None:
        """Delete the copy's files (its mapping stays valid while anything uses it)."""
        if self.path(model, version).exists():
            log.info("removed stored copy %s@%s", model, version)
        self._forget(model, version)
        self._prune()

    def clear(self) -> None:
        """A clean exit: every copy and the directory go."""
        with self._lock:
            self._live.clear()
        shutil.rmtree(self.root, ignore_errors=True)
        self._prune()
        self.close()

    def _prune(self) -> None:
        """Remove our directory once it holds no copy, then the cluster's once its
        last agent's went, then our default base once empty (an agent making its first
        copy meanwhile re-creates them: ``_mkroot`` retries)."""
        dirs = [self.root, self.root.parent] + ([DEFAULT_BASE] if self.root.parent.parent == DEFAULT_BASE else [])
        with self._lock:
            for d in dirs:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    continue
                except OSError:  # not empty: the rest is someone else's
                    return

    # --- after a restart -------------------------------------------------------------

    def recover(self) -> list[Copy]:
        """The surviving complete copies, each verified; every other one deleted."""
        copies = []
        for d in sorted(self.root.iterdir()) if self.root.is_dir() else []:
            try:
                copy = self._adopt(d)
            except _Drop as why:
                log.warning("dropped stored copy %s: %s", d.name, why)
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    d.unlink(missing_ok=True)
                continue
            with self._lock:
                self._live.add((copy.model, copy.version))
            log.info("re-adopted stored copy %s@%s (%d chunks, %d bytes) from %s", copy.model, copy.version,
                     len(copy.placed.views), sum(v.nbytes for v in copy.placed.views), d)
            copies.append(copy)
        if not copies:
            self._prune()
        return copies

    def _adopt(self, d: Path) -> Copy:
        import torch

        if not d.is_dir():
            raise _Drop("not a copy's directory")
        if not (d / "complete").exists():
            raise _Drop("incomplete (the agent stopped before it was verified)")
        try:
            record = msgspec.msgpack.decode((d / "manifest").read_bytes(), type=Record)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise _Drop(f"unreadable manifest ({exc})") from None
        if d.name != _key(record.model, record.version):
            raise _Drop(f"its manifest names {record.model}@{record.version}")
        if record.cluster != self.cluster:
            raise _Drop("made for another cluster (token fingerprint differs)")
        if not record.shards or len(record.shards) != (record.world if record.rank < 0 else 1):
            raise _Drop("its manifest lists no complete set of shards")
        try:
            size = (d / "data").stat().st_size
        except OSError as exc:
            raise _Drop(f"no data ({exc.strerror})") from None
        if size < record.nbytes:
            raise _Drop(f"data is {size} bytes, its manifest needs {record.nbytes}")
        try:
            data = self._map(d / "data", record.nbytes)
            tensors = {s.name: data[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
                       for s in record.slots}
            placed = place(record.shards, tensors)
        except (LayoutError, RuntimeError, AttributeError, TypeError) as exc:
            raise _Drop(f"its data does not fit its manifest ({exc})") from None
        bad = verify_placed(placed, record.shards)
        if bad:
            raise _Drop(f"checksum differs from its manifest in chunk(s) {bad[:10]}")
        return Copy(model=record.model, version=record.version, world=record.world, rank=record.rank,
                    shards=record.shards, placed=placed, tensors=tensors)


class _Drop(Exception):
    """Why a stored copy is not adopted."""


def verify_placed(placed: Placed, shards: list[p.Manifest]) -> list[int]:
    """Fill the staging buffer of every chunk that spans tensors from the tensors (the
    reverse of ``Placed.finish``: ``place`` left it empty), then re-hash every chunk as
    it will be served. → the global ids of chunks whose checksum differs."""
    for pieces in placed.scatter.values():
        for piece in pieces:
            piece.src[:piece.nbytes].copy_(piece.dst[piece.offset:piece.offset + piece.nbytes])
    expected = [c.checksum for m in shards for c in m.chunks]
    return [c for c, want in enumerate(expected) if placed.checksum(c) != want]
