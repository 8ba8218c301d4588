"""Live per-endpoint progress for ``th sync`` (rich Progress: bytes, MB/s, outcome)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ..launch.operate import SyncRun


class SyncView:
    def __init__(self, console: Console):
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TextColumn("{task.fields[outcome]}"), console=console, transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "SyncView":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, run: SyncRun) -> None:
        for name, t in run.targets.items():
            if name not in self.tasks:
                self.tasks[name] = self.progress.add_task(name, total=run.nbytes or None, outcome="")
            outcome = "[green]done[/]" if t.done else (f"[red]failed: {t.failed}[/]" if t.failed else "")
            self.progress.update(self.tasks[name], total=run.nbytes or None, completed=t.held_bytes, outcome=outcome)
