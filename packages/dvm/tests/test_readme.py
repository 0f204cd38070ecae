"""The package README: its usage example runs and says what it shows."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(run_readme_example) -> None:
    shown = run_readme_example(README)
    assert "1 region(s)" in shown
    assert "sigmoid" in shown
