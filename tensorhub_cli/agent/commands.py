"""What the agent does on the hub's commands: the handler its endpoint runs.

Protocol (on the endpoint's command workers: ``retain`` and ``discard`` one at a time
on one, ``fetch`` and ``load`` one at a time on the other; each outcome but
``discard``'s goes back to the hub as a ``Report``):

- ``retain``: fetch ``model@version`` into host memory from the agent's store
  (``agent.store``: files in /dev/shm that outlive the process) and hold it, so an
  unpublish elsewhere cannot drop a retained version below its copies (contract 4).
  The copy stays until the hub discards it or the agent leaves; once the fetch
  verified every chunk it is marked complete in the store, so a restarted agent
  offers it again. A failed fetch leaves no files.
- ``fetch`` (``th sync``): the same, asked by an operator (into what ``accept_sync``
  named, if anything did: that memory is the caller's, not the store's).
- ``load`` (``th publish --from``): read the checkpoint at ``path`` on this node (a
  safetensors file, or an HF checkpoint directory: ``adapters.hf.read_dir``, its
  index's shards or one ``model.safetensors``, by HF names) into store memory and
  publish it as ``model@version`` (``chunk_bytes``, else the endpoint's chunk size);
  complete in the store once the hub took the manifest.
- ``discard``: the hub forgot that version: drop our copy at once, no drain, and its
  files (unless a fetch still fills that version: it owns them until it ends).

Without a store (``store=None``) copies are plain process memory (``layout.allocate``)
and die with the agent. A store that cannot take a copy (tmpfs full) is logged and the
copy is made in process memory instead: retention must not fail for want of /dev/shm.

Waits: ``fetch_timeout`` (default 600 s) bounds a retain or fetch, ``publish_timeout``
(default 10 s) the hub's acceptance of a loaded manifest, ``report_timeout`` (default:
the endpoint's ``call_timeout_s``) each report.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..endpoint.commands import SyncCommands, carry_out
from ..hub import protocol as p
from ..layout import allocate
from .store import Store, StoreError

log = logging.getLogger("tensorhub.agent")


class AgentCommands:
    def __init__(self, store: Optional[Store] = None, *, fetch_timeout: float = 600.0,
                 publish_timeout: float = 10.0, report_timeout: Optional[float] = None):
        self.store = store
        self.sync = SyncCommands(fallback=allocate, fetch_timeout=fetch_timeout, report_timeout=report_timeout)
        self.publish_timeout = publish_timeout
        self.report_timeout = report_timeout

    def __call__(self, ep, cmd: p.Command) -> None:
        if cmd.action == "load":
            carry_out(ep, cmd, lambda: self.load(ep, cmd), timeout=self.report_timeout)
        elif cmd.action in ("retain", "fetch"):
            carry_out(ep, cmd, lambda: self.fetch_into(ep, cmd), timeout=self.report_timeout)
        elif cmd.action == "discard":
            self.discard(ep, cmd)
        elif cmd.action == "unpublish":  # `th unpublish`: drained, then the files go too
            self.sync(ep, cmd)
            self.drop_files(ep, cmd)
        else:
            self.sync(ep, cmd)

    def fetch_into(self, ep, cmd: p.Command) -> str:
        if self.store is None or cmd.model in ep.sync_into:
            return self.sync.fetch_into(ep, cmd)
        made: list[bool] = []  # whether this call's fetch allocated store files

        def into(shards: list[p.Manifest]) -> dict:
            try:
                tensors = self.store.allocate(cmd.model, cmd.version, shards)
            except StoreError as exc:
                log.warning("%s@%s held in process memory, lost if the agent dies: %s", cmd.model, cmd.version, exc)
                return allocate(shards)
            made.append(True)
            return tensors

        try:
            ep.fetch(cmd.model, cmd.version, into=into, timeout=self.sync.fetch_timeout)
        except BaseException:
            if made:
                self.store.remove(cmd.model, cmd.version)
            raise
        if made:
            self.store.complete(cmd.model, cmd.version)
        return f"{ep.last_fetch['bytes']} bytes"

    def discard(self, ep, cmd: p.Command) -> None:
        ep.discard(cmd.model, cmd.version)
        self.drop_files(ep, cmd)

    def drop_files(self, ep, cmd: p.Command) -> None:
        """The copy's store files, once we no longer hold it: a restarted agent must not
        offer a released or withdrawn version again."""
        if self.store is None:
            return
        # Still held: a fetch is filling it; its files are that fetch's (removed if it fails).
        if not any(h.model == cmd.model and h.version == cmd.version for h in ep.holdings()):
            self.store.remove(cmd.model, cmd.version)

    def load(self, ep, cmd: p.Command) -> str:
        state_dict = read_checkpoint(cmd.path)
        stored = False
        if self.store is not None:
            try:
                into = self.store.allocate_like(cmd.model, cmd.version, state_dict)
            except StoreError as exc:
                log.warning("%s@%s held in process memory, lost if the agent dies: %s", cmd.model, cmd.version, exc)
            else:
                for name, t in state_dict.items():
                    into[name].copy_(t)
                state_dict, stored = into, True
        try:
            manifest = ep.publish(cmd.model, cmd.version, state_dict, chunk_bytes=cmd.chunk_bytes or None,
                                  timeout=self.publish_timeout)
        except BaseException:
            if stored:
                self.store.remove(cmd.model, cmd.version)
            raise
        if stored:
            self.store.complete(cmd.model, cmd.version, shards=[manifest])
        return cmd.path


def read_checkpoint(path: str) -> dict:
    """A safetensors file, or an HF checkpoint directory (its shards, memory-mapped)."""
    from pathlib import Path

    if Path(path).is_dir():
        from ..adapters.hf import read_dir

        return read_dir(path)
    from safetensors.torch import load_file

    return load_file(path)
