"""The progress display on a terminal."""

from __future__ import annotations

from pathlib import Path

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


def test_metrics_cut_short_by_a_kill_are_read_without_their_last_line(tmp_path) -> None:
    """A process killed while writing a step's line left half a JSON record: the resume that
    reads the file crashed on it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in report.read_metrics(path)] == [1, 2]
    metrics = report.Metrics(path, 2, path)  # what a resume from step 2 does
    metrics.write({"step": 3, "loss": 1.0})
    metrics.close()
    assert [r["step"] for r in report.read_metrics(path)] == [1, 2, 3]


def test_a_resume_of_another_outputs_checkpoint_starts_from_that_outputs_log(
    tmp_path, monkeypatch
) -> None:
    """--resume a/checkpoints/step_N --output b kept b's own lines up to step N, those of an
    unrelated run, before the resumed run's steps: b's log now starts from a's."""
    from hyperparallel.train import run_log

    a, b = tmp_path / "a", tmp_path / "b"
    for out, loss in ((a, 1.0), (b, 9.0)):
        out.mkdir()
        (out / "metrics.jsonl").write_text(
            "".join(f'{{"step": {s}, "loss": {loss}}}\n' for s in (1, 2, 3))
        )
    resumed = a / "checkpoints" / "step_00000002"
    assert run_log(resumed, b) == a / "metrics.jsonl"
    assert run_log(b / "checkpoints" / "step_00000002", b) == b / "metrics.jsonl"  # its own
    assert run_log(tmp_path / "step_00000002", b) == b / "metrics.jsonl"  # outside an output
    moved = tmp_path / "store" / "checkpoints" / "step_00000002"  # no log beside them: b's
    assert run_log(moved, b) == b / "metrics.jsonl"
    (a / "checkpoints").mkdir()
    monkeypatch.chdir(a / "checkpoints")
    assert run_log(Path("step_00000002"), b) == a / "metrics.jsonl"  # relative, as typed
    metrics = report.Metrics(b / "metrics.jsonl", 2, run_log(resumed, b))
    metrics.write({"step": 3, "loss": 0.5})
    metrics.close()
    assert [(r["step"], r["loss"]) for r in report.read_metrics(b / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 1.0),
        (3, 0.5),
    ]


def test_a_log_of_another_output_that_is_no_file_is_not_passed_over(tmp_path) -> None:
    """A directory where the resumed run's log belongs gave b a fresh log, a's steps left out
    without a word; it is the log to read, and reading it fails (preflight reports it)."""
    from hyperparallel.train import run_log

    a, b = tmp_path / "a", tmp_path / "b"
    (a / "metrics.jsonl").mkdir(parents=True)
    assert run_log(a / "checkpoints" / "step_00000002", b) == a / "metrics.jsonl"
    with pytest.raises(IsADirectoryError):
        report.Metrics(b / "metrics.jsonl", 2, a / "metrics.jsonl")
    assert report.read_metrics(tmp_path / "none.jsonl") == []


def test_an_unreadable_metrics_line_is_named(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\nnot json\n{"step": 3, "loss": 1.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        report.read_metrics(path)
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')  # a whole line: not a cut
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record"):
        report.read_metrics(path)
    for line in ('{"loss": 1.0}', "[1, 2]", '"x"', "null", '{"step": 2, "loss": "1"}'):
        path.write_text(f'{{"step": 1, "loss": 2.0}}\n{line}\n')  # KeyError/TypeError raw
        with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics record \(a JSON"):
            report.read_metrics(path)
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe\n')  # named neither file nor line
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not UTF-8 text \(byte 0xff\)"):
        report.read_metrics(path)
    path.write_text('{"step": 1, "loss": null}\n')  # a diverged step's loss, as written
    assert report.read_metrics(path) == [{"step": 1, "loss": None}]


def test_the_summary_shows_paths_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """An output named ``runs/mk[baseline]`` was shown as ``runs/mk``; one holding ``[/x]``
    crashed the summary (MarkupError) after a finished run, which then exited 1."""
    rows = [("metrics", "runs/mk[baseline]/metrics.jsonl"), ("export", "runs/a[/x]/final")]
    report.summary(rows)
    shown = capsys.readouterr().out
    assert "runs/mk[baseline]/metrics.jsonl" in shown
    assert "runs/a[/x]/final" in shown


def test_the_loss_plot_leaves_out_a_null_loss(tmp_path) -> None:
    """A non-finite loss is logged as null; plotting such a log (a resume that trains nothing
    after a divergence) raised fmean's TypeError after the export."""
    path = tmp_path / "loss.png"
    report.plot([{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}], path, "run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
