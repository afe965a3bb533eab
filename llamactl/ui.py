"""The only module that imports rich: stderr console for progress and logs, stdout for results."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Iterable, Iterator, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

_state = {"quiet": False, "follower": False}


def _console(stderr: bool) -> Console:
    # rich turns colour and live displays off by itself when the stream is not a terminal.
    # bound to the stream of the moment, so that a library's output redirected later (GPTQModel's
    # into quantize.log) does not take llamactl's progress with it
    return Console(file=sys.stderr if stderr else sys.stdout, no_color="NO_COLOR" in os.environ, highlight=False,
                   soft_wrap=not stderr)


def set_quiet(quiet: bool) -> None:
    _state["quiet"] = quiet


def follow() -> None:
    """A tensor-parallel rank other than 0: rank 0 speaks for the group; errors still print."""
    _state["quiet"] = _state["follower"] = True
    sys.stdout = open(os.devnull, "w")


def log(message: str, markup: bool = True) -> None:
    """A progress or status line on stderr (silenced by --quiet), never broken into several lines
    (logs are grepped); markup=False prints brackets in the message as they are."""
    if not _state["quiet"]:
        _console(stderr=True).print(message, markup=markup, soft_wrap=True)


def warn(message: str) -> None:
    if not _state["follower"]:
        _console(stderr=True).print(f"[yellow]warning:[/yellow] {message}")


def error(message: str, hint: str | None = None) -> None:
    line = f"error: {message}" + (f"; {hint}" if hint else "")
    Console(stderr=True, highlight=False, soft_wrap=True, no_color="NO_COLOR" in os.environ).print(
        line, markup=False, style="bold red")


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]], stderr: bool = False) -> None:
    console = _console(stderr=stderr)
    if not console.is_terminal:  # piped: the table's own width, nothing squeezed or cut (scripts read it)
        console.width = 10_000
    t = Table(title=title and escape(title), show_header=True, header_style="bold")
    for i, c in enumerate(columns):
        t.add_column(escape(c), justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*(escape(str(x)) for x in r))  # data, not markup: "[parent missing]" is shown
    console.print(t)


def kv_table(title: str | None, items: Iterable[tuple[str, Any]]) -> None:
    t = Table(title=title, show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in items:
        t.add_row(escape(k), escape(str(v)))
    _console(stderr=False).print(t)


@contextlib.contextmanager
def progress(description: str, total: int | None) -> Iterator[Any]:
    """A progress bar with ETA on stderr; yields advance(n=1, description=None)."""
    if _state["quiet"]:
        yield lambda n=1, description=None: None
        return
    p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 TextColumn("eta"), TimeRemainingColumn(), console=_console(stderr=True), transient=False)
    with p:
        task = p.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None) -> None:
            p.update(task, advance=n, **({"description": description} if description else {}))

        yield advance


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
