"""Terminal output: a diagnosis panel, progress on long work, plain text when not a TTY."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from rich.console import Console as RichConsole
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from nanguard.explain import where_lines
from nanguard.findings import Diagnosis

__all__ = ["Console", "diagnosis_panel"]

_KIND = {"nan": "NaN", "inf": "Inf"}


def diagnosis_panel(diag: Diagnosis) -> Panel:
    """A rich panel: cause, what was created, where, why, and fixes."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column()
    grid.add_row("cause", Text(f"{diag.cause}", style="bold red") + Text(f"  {diag.meaning}"))
    grid.add_row("created", _KIND.get(diag.kind, diag.kind))
    for label, value in where_lines(diag):
        grid.add_row(label, value)
    why = diag.evidence.get("why")
    if why:
        grid.add_row("why", why)
    for i, fix in enumerate(diag.fixes, start=1):
        grid.add_row("try" if i == 1 else "", f"{i}. {fix}")
    title = f"nanguard: {_KIND.get(diag.kind, diag.kind)} at step {diag.step}" if diag.step is not None else "nanguard"
    return Panel(grid, title=title, title_align="left", border_style="red")


class Console:
    """Rich output on a terminal; plain lines (no colour, no bars) when piped."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file or sys.stdout
        self.rich = RichConsole(file=self.file, highlight=False, soft_wrap=not self.file.isatty())
        self.tty = self.file.isatty()

    def title(self, title: str, subtitle: str = "") -> None:
        self.rich.rule(f"[bold]{title}" if self.tty else title)
        if subtitle:
            self.line(subtitle)

    def line(self, text: str) -> None:
        if self.tty:
            self.rich.print(text)
        else:
            print(text, file=self.file, flush=True)

    def diagnosis(self, diag: Diagnosis | None) -> None:
        if diag is None:
            return
        if self.tty:
            self.rich.print(diagnosis_panel(diag))
        else:
            print(str(diag), file=self.file, flush=True)

    @contextlib.contextmanager
    def progress(self, total: int, label: str) -> Iterator[Callable[[str], None]]:
        """Yields ``advance(message)``: a bar on a TTY, one line per item otherwise."""
        if not self.tty:
            yield lambda message: print(message, file=self.file, flush=True)
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.rich, transient=False) as bar:
            task = bar.add_task(label, total=total)

            def advance(message: str) -> None:
                bar.console.print(message)
                bar.advance(task)

            yield advance
