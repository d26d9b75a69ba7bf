"""Terminal output: a diagnosis panel, tables, progress on long work, plain text when not a TTY."""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

from rich.console import Console as RichConsole
from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from nanguard.findings import Diagnosis
from nanguard.text import diagnosis_text, evidence_lines, kind_name, where_lines

__all__ = ["Console", "diagnosis_panel", "diagnosis_text", "safe"]

# Escape sequences (CSI, OSC, and the two-byte ones) first, then any other C0/C1 control character.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?|\x9b[0-?]*[ -/]*[@-~]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def safe(text: object) -> str:
    """``text`` as a string that cannot drive the terminal: escape sequences and control characters
    (other than newline and tab) removed. Everything from a log, a model or a batch goes through it.

    Example:
        >>> safe("blocks.0\x1b]0;pwned\x07\x1b[31m.attn")
        'blocks.0.attn'
    """
    return _CONTROLS.sub("", _ESCAPES.sub("", str(text)))


def _title(diag: Diagnosis) -> str:
    kind = kind_name(diag.kind)
    return safe(f"nanguard: {kind} at step {diag.step}" if diag.step is not None else f"nanguard: {kind}")


def diagnosis_panel(diag: Diagnosis) -> Panel:
    """A rich panel: the cause, what was created, where, the evidence in words, and fixes.

    Example:
        >>> rich.print(diagnosis_panel(guard.last_diagnosis))
    """
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True, justify="right")
    grid.add_column(overflow="fold")
    grid.add_row("cause", Text(safe(diag.cause), style="bold red") + Text(f"  {safe(diag.meaning)}"))
    grid.add_row("created", Text(safe(kind_name(diag.kind)), style="bold"))
    for label, value in where_lines(diag):
        grid.add_row(Text(label), Text(safe(value), style="bold" if label in ("module", "op") else ""))
    evidence = evidence_lines(diag)
    if evidence:
        grid.add_row("", "")
        for label, value in evidence:
            grid.add_row(Text(safe(label)), Text(safe(value)))
    if diag.fixes:
        grid.add_row("", "")
        for i, fix in enumerate(diag.fixes, start=1):
            grid.add_row("try" if i == 1 else "", Text(f"{i}. ") + Text(safe(fix), style="green"))
    return Panel(grid, title=Text(_title(diag)), title_align="left", border_style="red")


class Console:
    """Rich output on a terminal; plain lines (no colour, no bars) when piped.

    Every string is shown as text, never as rich markup, and passes through ``safe``.

    Example:
        >>> console = Console()
        >>> console.title("nanguard report", "runs/exp1")
        >>> console.diagnosis(guard.last_diagnosis)
    """

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file or sys.stdout
        self.tty = _isatty(self.file)
        self.rich = RichConsole(file=self.file, highlight=False, soft_wrap=not self.tty)

    def title(self, title: str, subtitle: str = "") -> None:
        if self.tty:
            self.rich.rule(Text(safe(title), style="bold"))
        else:
            print(f"== {safe(title)} ==", file=self.file, flush=True)
        if subtitle:
            self.line(subtitle)

    def line(self, text: str) -> None:
        if self.tty:
            self.rich.print(Text(safe(text)))
        else:
            print(safe(text), file=self.file, flush=True)

    def diagnosis(self, diag: Diagnosis | None) -> None:
        if diag is None:
            return
        if self.tty:
            self.rich.print(diagnosis_panel(diag))
        else:
            print(safe(diagnosis_text(diag)), file=self.file, flush=True)

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[str]], title: str = "") -> None:
        """A table: rich on a terminal, space-aligned columns otherwise."""
        columns = [safe(c) for c in columns]
        rows = [[safe(v) for v in row] for row in rows]
        title = safe(title)
        if self.tty:
            heading = Text(title) if title else None
            table = Table(*columns, title=heading, title_justify="left", header_style="bold cyan")
            for row in rows:
                table.add_row(*(Text(v) for v in row))
            self.rich.print(table)
            return
        widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
        lines = [title] if title else []
        lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        print("\n".join(lines), file=self.file, flush=True)

    def group(self, *lines: str) -> None:
        """Several lines printed as one block."""
        if self.tty:
            self.rich.print(Group(*(Text(safe(line)) for line in lines)))
        else:
            print("\n".join(safe(line) for line in lines), file=self.file, flush=True)

    @contextlib.contextmanager
    def progress(self, total: int, label: str, *, echo: bool = True) -> Iterator[Callable[[str], None]]:
        """Yields ``advance(message)``: a bar on a TTY, one line per item otherwise.

        With ``echo=False`` the messages only label the bar, and nothing is printed when
        the output is not a terminal (for work whose items are not news, like reading files).
        A ``total`` of 0 is an unknown one.
        """
        if not self.tty:
            if echo:
                yield lambda message: print(safe(message), file=self.file, flush=True)
            else:
                yield lambda message: None
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.rich, transient=not echo) as bar:
            task = bar.add_task(escape(safe(label)), total=total or None)

            def advance(message: str) -> None:
                if echo:
                    bar.console.print(Text(safe(message)))
                else:
                    bar.update(task, description=escape(safe(f"{label}: {message}")))
                bar.advance(task)

            yield advance


def _isatty(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False
