"""The one table every `th` command prints: it reads at 80 columns and in a pipe.

Protocol: ``Grid(*headers, title=..., names=(...))`` is a rich ``Table`` drawn as
kubectl and docker draw theirs: no vertical rules, a rule under the header, two
spaces between columns, so a row costs its cells and little else. Each column is at
least as wide as the longest word it holds (header included): when the console is
narrow (80 columns; a pipe, which rich treats as 80 unless ``COLUMNS`` says
otherwise) rich wraps cells between words, never inside one. The columns ``names``
lists (endpoint, node, fault names; several in one cell go one per line) never wrap
at all: a name is read whole or not at all. A title wraps at the table's width: keep
it short, and say the rest in a line after the table. A table is laid out so that its
narrowest form fits 80 columns; the tests render each at 80 and look for a split.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

WIDTH = 80  # the narrowest console every table is laid out for


def _plain(cell) -> str | None:
    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return None  # a renderable (a progress bar) measures itself


class Grid(Table):
    def __init__(self, *headers: str, title: str | None = None, names: tuple[str, ...] = (), **kwargs) -> None:
        super().__init__(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                         collapse_padding=True, **kwargs)
        for header in headers:
            self.add_column(header, no_wrap=header in names, overflow="ellipsis" if header in names else "fold",
                            min_width=max(map(len, header.split())) if header in names else _longest(header))
        self._names = {i for i, h in enumerate(headers) if h in names}

    def add_row(self, *cells, **kwargs) -> None:
        for i, cell in enumerate(cells):
            text = _plain(cell)
            if text is None:
                continue
            column = self.columns[i]
            widest = max(map(len, text.splitlines() or [""])) if i in self._names else _longest(text)
            column.min_width = max(column.min_width or 0, widest)
        super().add_row(*cells, **kwargs)


def _longest(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


def lines(items: list[str], shown: int | None = None) -> str:
    """Names one per line (``shown``: the first so many, then ``+N``); ``-`` for none."""
    if not items:
        return "-"
    if shown is not None and len(items) > shown:
        return "\n".join(items[:shown] + [f"+{len(items) - shown}"])
    return "\n".join(items)
