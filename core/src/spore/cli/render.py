"""The one way the ``spore`` command line prints: JSON for machines, else a rich table.

Tables fit the console (80 columns in a pipe unless ``COLUMNS`` says otherwise): names never
wrap, other cells wrap at word boundaries, and long prose is printed under the table.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TextIO

import click

if TYPE_CHECKING:  # rich is imported when something is printed
    from rich.console import Console, RenderableType
    from rich.text import Text

TEXT_MIN = 16  # a text column is at least as wide as its longest word, up to this

STATUS_STYLE = {
    "active": "green",
    "ok": "green",
    "info": "cyan",
    "disabled": "dim",
    "warn": "yellow",
    "incompatible": "yellow",
    "failed": "red",
    "error": "red",
}


@dataclass(frozen=True)
class Column:
    """A table column: its header, how a row's cell is written (plain text, shown as it is,
    or a styled ``rich.text.Text``), and its kind.

    ``name``: never wraps (names, statuses, figures); ``text``: wraps at word boundaries;
    ``note``: long prose, printed under the table as ``LABEL  TEXT`` for the rows that have one.
    """

    header: str
    cell: Callable[[Any], str | Text]
    kind: Literal["name", "text", "note"] = "text"


def console(stderr: bool = False) -> Console:
    """A rich console without automatic highlighting (its width: the terminal's, else 80)."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def styled(status: str, rest: str = "") -> Text:
    """``status`` in its colour, then ``rest`` as it is."""
    from rich.text import Text

    return Text.assemble((status, STATUS_STYLE.get(status, "")), rest)


def _text(cell: str | Text) -> Text:
    """A cell as rich text: a string's ``[...]`` is its own text, never markup."""
    from rich.text import Text

    return cell if isinstance(cell, Text) else Text(cell)


_JSON_STDOUT = "spore.json_stdout"  # ctx.meta key: the stdout that --json's JSON goes to


def _json_flag(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    """With ``--json``, whatever else the command prints (a plugin printing at import, a
    benchmark's own output, a C extension or a child process writing to file descriptor 1)
    goes to stderr until the command ends: stdout holds the JSON."""
    if value:
        ctx.meta[_JSON_STDOUT] = ctx.with_resource(_stdout_to_stderr())
    return value


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[TextIO]:
    """Point stdout, Python's and file descriptor 1 where both are real descriptors, at
    stderr; yields a stream to the original stdout."""
    json_out = sys.stdout
    try:
        real = json_out.fileno() == 1 and sys.stderr.fileno() != 1
    except (AttributeError, OSError, ValueError):  # a test runner's, a notebook's, closed
        real = False
    if not real:
        with contextlib.redirect_stdout(sys.stderr):
            yield json_out
        return
    json_out.flush()
    saved = os.dup(1)
    try:
        original = os.fdopen(os.dup(saved), "w", encoding=json_out.encoding)
        try:
            os.dup2(sys.stderr.fileno(), 1)
            with contextlib.redirect_stdout(sys.stderr):
                yield original
        finally:
            original.close()
            sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


JSON_OPTION = click.option(
    "--json",
    "as_json",
    is_flag=True,
    callback=_json_flag,
    help="Machine-readable output on stdout (anything else printed goes to stderr).",
)


def echo_json(data: Any) -> None:
    """``data`` as JSON on the command's stdout (kept apart by ``--json``, see JSON_OPTION);
    a NaN or infinite number is ``null`` (JSON has neither)."""
    ctx = click.get_current_context(silent=True)
    out = ctx.meta.get(_JSON_STDOUT) if ctx is not None else None
    click.echo(json.dumps(_finite(data), indent=2, sort_keys=False, allow_nan=False), file=out)


def _finite(value: Any) -> Any:
    """``value`` with each non-finite float inside dicts, lists and tuples as ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _min_width(column: Column, texts: list[Text]) -> int:
    if column.kind == "name":
        return max([0, *(t.cell_len for t in texts)])
    return min(TEXT_MIN, max([0, *(len(word) for t in texts for word in t.plain.split())]))


def table(
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Any],
    *,
    label: str | None = None,
    width: int = 80,
) -> RenderableType:
    """``rows`` as a table ``width`` columns wide at most, then the note columns (each note
    labelled with the row's cell in column ``label``, default the first).

    A name column is as wide as its longest cell, a text column as its longest word (up to
    ``TEXT_MIN``); a table whose columns cannot fit that way is wider than ``width``.
    """
    from rich.console import Group
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    shown = [c for c in columns if c.kind != "note"]
    key = next(c for c in columns if c.header == label) if label else shown[0]
    cells = [[_text(column.cell(row)) for column in shown] for row in rows]
    minimums = [_min_width(column, [row[i] for row in cells]) for i, column in enumerate(shown)]
    needed = sum(minimums) + 3 * len(shown) + 1  # a cell pads 1 either side; a border each
    out = Table(title=title, width=needed if needed > width else None)
    for column, least in zip(shown, minimums, strict=True):
        out.add_column(
            column.header, no_wrap=column.kind == "name", overflow="fold", min_width=least
        )
    for row in cells:
        out.add_row(*row)
    parts: list[RenderableType] = [out]
    for note in (c for c in columns if c.kind == "note"):
        lines = [(_text(key.cell(row)), _text(note.cell(row))) for row in rows if note.cell(row)]
        if not lines:
            continue
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column(overflow="fold")
        for line in lines:
            grid.add_row(*line)
        parts += [Text(f"{note.header}:"), Padding(grid, (0, 0, 0, 2))]
    return Group(*parts)


def print_table(
    title: str, columns: Sequence[Column], rows: Sequence[Any], *, label: str | None = None
) -> None:
    """Print :func:`table` on stdout at the console's width (never cropped)."""
    out = console()
    out.print(table(title, columns, rows, label=label, width=out.width), crop=False)


def emit(
    rows: Sequence[dict[str, Any]],
    *,
    as_json: bool,
    title: str,
    columns: Sequence[Column],
    empty: str,
) -> None:
    """Print a listing: the rows as JSON, else a table (``empty`` when there are no rows)."""
    if as_json:
        echo_json(rows)
    elif not rows:
        click.echo(empty)
    else:
        print_table(title, columns, rows)
