"""The package README: its usage example runs and shows what it says."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(run_readme_example) -> None:
    shown = run_readme_example(README)
    assert "chunked equals whole: True" in shown
    assert "recompute='block'" in shown
    assert "smooth LDDT loss: 0." in shown
