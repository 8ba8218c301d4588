"""The consoles and the one way a `th` command reports a problem.

Protocol: results go to ``out`` (stdout), progress and notes to ``err`` (stderr);
``step`` lines (what `th up`, `th down`, `th scale` do as they go) are silent under
``th -q``. A problem is ``fail(message, code)``: plain lines on stderr, the first
starting ``th COMMAND: `` (``th bench fanout: ``, never a bare ``th:``), then exit
1 (the operation failed) or 2 (bad input). Hub protocol codes (``not_found: ``) never
reach the user: ``plain`` drops them, the message says it in words. The command
groups' callbacks call ``entered`` as the command line is parsed, so ``fail`` knows
which command it speaks for.
"""

from __future__ import annotations

import re
from typing import NoReturn

import typer
from rich.console import Console

out = Console()
err = Console(stderr=True)

_command: list[str] = ["th"]  # the words of the command being run, as far as parsed
_quiet = [False]

# The hub's error codes (hub/faults.py HubFault, service.py): words for machines.
# ("version" is one too, but also a word messages use: left alone.)
HUB_CODES = ("auth", "bad_request", "conflict", "draining", "expired", "fenced", "internal", "malformed", "not_found",
             "not_ready", "not_registered", "rebuilding", "timeout", "too_large", "unavailable", "unknown_endpoint")
_TAG = re.compile(r"(^|: |\()(?:" + "|".join(HUB_CODES) + r"): ")


def entered(words: list[str], reset: bool = False) -> None:
    """The command line reached ``words`` (``["bench"]``, then ``["fanout"]``)."""
    if reset:
        _command[:] = ["th"]
    _command.extend(w for w in words if w)


def set_quiet(quiet: bool) -> None:
    _quiet[0] = quiet


def command_path() -> str:
    return " ".join(_command)


def plain(message: str) -> str:
    """``message`` without hub protocol codes (``not_found: model 'x' ...`` → ``model 'x' ...``)."""
    return _TAG.sub(lambda m: m.group(1), message)


def fail(message: str, code: int) -> NoReturn:
    """Print ``th COMMAND: message`` (plain: problem lines are never wrapped or styled)
    on stderr and exit ``code``. A message already carrying the prefix keeps it once."""
    prefix = command_path()
    text = plain(str(message))
    if not text.startswith(prefix + ":"):
        text = f"{prefix}: {text}"
    typer.echo(text, err=True)
    raise typer.Exit(code)


def step(line: str, console: Console | None = None) -> None:
    """A progress line (silent under ``-q``), printed as is: no markup, no highlighting."""
    if not _quiet[0]:
        (console or out).print(line, highlight=False, markup=False, soft_wrap=True)
