"""Retention (contract 4): which versions must keep copies, and who can make one.

Per model, the ``keep_latest`` highest once-READY versions are *retained*, leaving out
versions an operator withdrew (``th unpublish``): those get no copy, and their last
copy is not held back, so the next older version moves into keep_latest. A retained
version is *short* when its non-draining replicas no longer cover the manifest, or
fewer than ``min_reliable_copies`` of them are complete copies on reliable endpoints.
A short version gets a host-tier copy: an agent is asked to pull and publish it, and
an unpublish that caused the shortage is acknowledged only once the copy is complete,
or once no agent is left that could make it.

A version older than all ``keep_latest`` retained ones is *outranked*: it would be
dropped the moment it turned READY, so the hub refuses to publish it (``stale``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Version


@dataclass(frozen=True)
class Policy:
    keep_latest: int = 2
    min_reliable_copies: int = 1


def retained(versions: dict[int, Version], policy: Policy, withdrawn=frozenset()) -> list[int]:
    """The retained version numbers, newest first; ``withdrawn``: numbers left out."""
    return sorted((n for n, v in versions.items() if v.ever_ready and n not in withdrawn),
                  reverse=True)[: policy.keep_latest]


def outranked(number: int, versions: dict[int, Version], policy: Policy, withdrawn=frozenset()) -> list[int]:
    """The retained versions that would leave ``number`` out of keep_latest once it is
    READY (newest first), or [] when ``number`` would be kept. ``drop_old`` forgets such
    a version as soon as nobody reads it: a publish of it must be refused instead."""
    kept = retained(versions, policy, withdrawn)
    if policy.keep_latest > 0 and len(kept) >= policy.keep_latest and number < kept[-1]:
        return kept
    return []


def _live_copies(version: Version, reliable) -> tuple[bool, int]:
    covered, copies = 0, 0
    for r in version.replicas.values():
        if r.endpoint in version.draining:
            continue
        covered |= r.held
        copies += r.held == version.full and reliable(r.endpoint)
    return covered == version.full, copies


def short(version: Version, policy: Policy, reliable) -> bool:
    covered, copies = _live_copies(version, reliable)
    return not covered or copies < policy.min_reliable_copies


def pulls_needed(version: Version, policy: Policy, reliable) -> int:
    """How many more agent pulls to start, counting those already under way."""
    covered, copies = _live_copies(version, reliable)
    if covered and copies >= policy.min_reliable_copies:
        return 0
    need = policy.min_reliable_copies - copies if copies < policy.min_reliable_copies else 1
    under_way = sum(1 for a in version.pulls if not version.complete(a))
    return max(0, need - under_way)
