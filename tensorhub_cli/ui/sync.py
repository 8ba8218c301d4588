"""Live per-endpoint progress for ``th sync`` (rich Progress: bytes, MB/s, outcome).

A target that completed before a second sample existed (an instant sync: it held the
version already, or the copy took less than one poll) has no rate: it shows ``-``,
not rich's ``?``. The bars fit 80 columns (a pipe): a failed target shows ``failed``,
its reason is in the line `th sync` ends with. ``interrupted`` is what Ctrl-C leaves
behind: the targets were asked already and finish on their own; `th sync` only watched.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Column
from rich.text import Text

from ..launch.operate import SyncRun


class _Rate(TransferSpeedColumn):
    def render(self, task) -> Text:
        if (task.finished_speed or task.speed) is None:
            return Text("-", style="progress.data.speed")
        return super().render(task)


class SyncView:
    def __init__(self, console: Console):
        # Fixed widths that fit 80 columns: names and byte counts never wrap; a failure
        # shows as "failed" here and its reason in the command's closing line.
        self.progress = Progress(
            TextColumn("{task.description}", table_column=Column(no_wrap=True)), BarColumn(bar_width=20),
            DownloadColumn(binary_units=True, table_column=Column(no_wrap=True)),
            _Rate(table_column=Column(no_wrap=True)), TextColumn("{task.fields[outcome]}"), console=console,
            transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "SyncView":
        return self  # the bars start with the first update: a sync refused at once prints only its error

    def __exit__(self, *exc) -> None:
        if self.tasks:
            self.progress.stop()

    def update(self, run: SyncRun) -> None:
        if not self.tasks and run.targets:
            self.progress.start()
        for name, t in run.targets.items():
            if name not in self.tasks:
                self.tasks[name] = self.progress.add_task(name, total=run.nbytes or None, outcome="")
            outcome = "[green]done[/]" if t.done else ("[red]failed[/]" if t.failed else "")
            self.progress.update(self.tasks[name], total=run.nbytes or None, completed=t.held_bytes, outcome=outcome)


def interrupted(model: str, run: SyncRun | None) -> str:
    """What Ctrl-C during `th sync` leaves behind: the targets were asked already and
    fetch on their own; this command only watched them."""
    if run is None:
        return ("interrupted before the hub answered: the sync may have been asked for already; "
                f"`th status --watch` shows any fetch of {model} under way")
    going = [t for t in run.targets.values() if not t.done and not t.failed]
    if not going:
        return f"interrupted; every target of {model}@{run.version} had finished"
    size = f"{run.nbytes / 2**20:.1f} MiB" if run.nbytes else "?"
    where = ", ".join(f"{t.name} {t.held_bytes / 2**20:.1f}/{size}" for t in sorted(going, key=lambda t: t.name))
    return (f"interrupted: this command only watched; the targets go on fetching {model}@{run.version} on their own "
            f"(when interrupted: {where}). `th status --watch` follows them; nothing stops a fetch midway: "
            f"to take a node's copy away, `th unpublish {model} {run.version} --node NODE` (it waits for that "
            "node's reads to end)")
