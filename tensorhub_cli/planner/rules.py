"""Source-choice rules beside the greedy choice: pure functions over plain data.

Each rule answers one question a plan asks about a version's holders. The hub keeps
the tables (who holds which chunks, loads, seeds); these functions only read them
(``spread`` also fills the caller's cache), so each is testable with plain dicts.

- ``may_cross``: contract 8's one-copy-per-DC-link rule (the DC's *seed*).
- ``spread``: the chunks readers in a DC hold, which a publisher need not send there;
  ``copies`` also the chunks two or more of them hold (``withheld`` picks between them).
- ``full_held``: chunks that sources at their read cap hold in the reader's DC, which
  wait for those sources rather than cross a DC link.
- ``serving_mask``: chunks a source is sending right now, better relayed than re-sent.
"""

from __future__ import annotations

from typing import Callable, Collection, Mapping, Protocol


class Holding(Protocol):
    """A replica as the planner sees it."""

    held: int  # bitset of chunks held (bit i = chunk i)
    rank: int  # >= 0: a publisher's shard; -1: a reader's replica


def may_cross(seed: str | None, reader: str, seed_active: bool) -> bool:
    """Whether ``reader`` may read across its DC's link now. One reader per DC (the
    seed) pulls across at a time; the others read what it relays. A seed that is no
    longer active (done, stopped, cancelled, or letting its replica go) hands the
    role on, so a stalled seed never blocks its DC. The caller drops an inactive seed."""
    return seed is None or seed == reader or not seed_active


def spread(holders_in_dc: Collection[str], replicas: Mapping[str, Holding], draining: Collection[str]) -> int:
    """The chunks that readers (not publishers) in one DC hold and may serve: a
    publisher sends into that DC only chunks outside this set, so its link carries
    one copy and readers relay the rest."""
    return copies(holders_in_dc, replicas, draining)[0]


def copies(holders_in_dc: Collection[str], replicas: Mapping[str, Holding],
           draining: Collection[str]) -> tuple[int, int]:
    """(chunks one or more readers in the DC hold, chunks two or more hold): the
    ``spread`` set, and the chunks whose relaying no longer hangs on one reader's link."""
    once = twice = 0
    for name in holders_in_dc:
        rep = replicas.get(name)
        if rep is not None and rep.rank < 0 and name not in draining:
            twice |= once & rep.held
            once |= rep.held
    return once, twice


def withheld(held: int, once: int, twice: int, sending: int) -> int:
    """The chunks a publisher holding ``held`` does not send into a DC whose readers
    hold ``once`` (``twice``: two or more of them), while it sends ``sending``.

    While it still has a chunk no reader there holds or is being sent (a fresh one),
    it withholds every relayed chunk: its link is the fan-out's bottleneck and carries
    one copy. Once nothing fresh is left (the end of a fan-out), its link would idle
    while the last chunks hang on the one reader holding each: then it serves those
    too, and withholds only chunks two readers hold. A replicated version (a joiner
    arriving later) is then still read from readers alone."""
    if held & ~once & ~sending:
        return once
    return twice


def full_held(full_in_dc: Collection[str], replicas: Mapping[str, Holding], want: int,
              closed: Collection[str], alive: Callable[[str], bool]) -> int:
    """The chunks of ``want`` that sources at their read cap in the reader's DC hold:
    such chunks wait for those sources rather than cross a DC link (cost before load)."""
    out = 0
    for name in full_in_dc:
        rep = replicas.get(name)
        # What it would add first: once ``out`` has its chunks, liveness is moot.
        if rep is not None and rep.held & want & ~out and name not in closed and alive(name):
            out |= rep.held & want
            if out == want:
                break
    return out


def serving_mask(sending: Mapping[int, int] | None) -> int:
    """The chunks a source is sending to some reader now (``chunk -> readers``)."""
    mask = 0
    for chunk in sending or ():
        mask |= 1 << chunk
    return mask
