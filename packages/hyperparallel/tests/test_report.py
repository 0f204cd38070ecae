"""The progress display on a terminal."""

from __future__ import annotations

import pytest

from hyperparallel import report


def test_a_run_name_with_markup_is_shown_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich reads ``[...]`` in a column's text as markup: a run named ``a[/red]b[x]`` crashed
    the bar (MarkupError) or lost its ``[x]``."""
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, as far as rich is concerned
    display = report.ProgressDisplay("a[/red]b[x]", total=3, start=0, log_every=1)
    try:
        assert display.live
        display.update(1, 0.5, 100.0, 0.1)
        task = display.progress.tasks[0]
        assert display.progress.columns[0].render(task).plain == "a[/red]b[x]"
    finally:
        display.close()
