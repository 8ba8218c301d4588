"""What a model name may be, checked the same way by the hub, the endpoint and `th`.

Protocol. A model name matches ``MODEL_PATTERN``: 1 to 64 characters, letters, digits,
``.``, ``_`` and ``-``, starting with a letter or a digit. It is the spec's ``Name``
(``spec.model.Name``: node, rack, DC and cluster names), so a model the spec declares
always passes, and a name travels into file paths, event lines, metric labels and
command lines without quoting. ``check_model(name, what)`` returns the name or raises
``BadArgument`` (a ``ValueError``) whose message names ``what`` (the argument at fault)
and shows the pattern. Standard library only: the CLI checks before importing anything
heavy.
"""

from __future__ import annotations

import re

from .errors import BadArgument

MODEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_MODEL = re.compile(MODEL_PATTERN)
RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64 characters"


def valid_model(name: object) -> bool:
    # fullmatch: "$" alone would also accept a trailing newline
    return isinstance(name, str) and _MODEL.fullmatch(name) is not None


def check_model(name: object, what: str = "model") -> str:
    """``name`` if it is a valid model name; else ``BadArgument`` naming ``what``."""
    if not valid_model(name):
        raise BadArgument(f"{what} {name!r} is not a valid model name: it must match {MODEL_PATTERN} ({RULE})")
    return name  # type: ignore[return-value]
