"""Every error the public API raises: one hierarchy under ``TensorHubError``.

Protocol. A caller that catches ``TensorHubError`` catches everything TensorHub raises
on purpose; the subclasses say what went wrong, and each keeps the built-in base it
had before this hierarchy existed, so older ``except`` clauses still match:

``TensorHubError``
    ``BadArgument`` (also ``ValueError``): an argument of a public call is wrong; the
        message names it. Also an ``EndpointError``: the endpoint refused the call, and
        nothing changed.
    ``EndpointError`` (also ``RuntimeError``): the endpoint refused a call (closed, that
        memory is still published, ...) or could not reach a state in time; nothing
        changed that its message does not name.
    ``FetchError`` (also ``RuntimeError``): a fetch that had started failed; the
        destination holds no version.
    ``LayoutError`` (also ``ValueError``): a state_dict does not fit a manifest; nothing
        was written. ``problems`` lists every mismatch.
    ``HubError``: the hub refused an operation; ``code`` is its reason (``not_found``,
        ``unavailable``, ``draining``, ``fenced``, ``conflict``, ``stale``: a publish
        the hub would not keep, ``auth``: a bad cluster token, final at once, ...),
        ``error`` the hub's answer.
        ``VersionNotFound``: a fetch named a version (or ``latest``) the hub cannot
            resolve yet: unknown (``not_found``) or not READY (``not_ready``).
    ``HubUnreachable``: the hub did not answer within the call's timeout.
    ``TensorHubTimeout`` (also ``TimeoutError``): a wait ran out of time.
        ``VersionTimeout`` (also ``VersionNotFound``): a waiting fetch's version did not
            become READY within its timeout (so ``except VersionNotFound`` handles both
            the fast and the waiting form of "not there").

This module imports nothing beyond the standard library: ``import tensorhub_cli``
exports these names and must stay cheap (no zmq, msgspec or torch).
"""

from __future__ import annotations

__all__ = ["TensorHubError", "BadArgument", "EndpointError", "FetchError", "LayoutError", "HubError",
           "VersionNotFound", "HubUnreachable", "TensorHubTimeout", "VersionTimeout"]


class TensorHubError(Exception):
    """The base of every error TensorHub raises on purpose."""


class EndpointError(TensorHubError, RuntimeError):
    """The endpoint refused a call or could not reach a state in time."""


class BadArgument(EndpointError, ValueError):
    """An argument of a public call is wrong; the message names it."""


class FetchError(TensorHubError, RuntimeError):
    """A fetch that had started failed; the destination holds no version."""


class LayoutError(TensorHubError, ValueError):
    """The state_dict does not fit: ``problems`` lists every mismatch, one per line."""

    def __init__(self, what: str, problems: list[str]):
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__(f"{what}:\n  " + "\n  ".join(shown))
        self.problems = problems


class HubError(TensorHubError):
    """The hub refused an operation. ``error``: its answer (a ``protocol.Error``, or
    anything with ``code`` and ``message``); ``code``: the reason."""

    def __init__(self, error):
        super().__init__(f"{error.code}: {error.message}")
        self.error = error
        self.code = error.code

    def __reduce__(self):  # (the default would call __init__ with the message string)
        return type(self), (self.error,)


class VersionNotFound(HubError):
    """A fetch named a version the hub cannot resolve yet (``not_found``, ``not_ready``)."""


class HubUnreachable(TensorHubError):
    """The hub did not answer within the call's timeout."""


class TensorHubTimeout(TensorHubError, TimeoutError):
    """A wait ran out of time; the message names what was waited for."""


class VersionTimeout(VersionNotFound, TensorHubTimeout):
    """A waiting fetch's version did not become READY within the fetch's timeout."""
