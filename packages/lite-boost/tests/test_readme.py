"""The package README: its usage example runs."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(run_readme_example) -> None:
    assert "runs lite-boost:sdpa" in run_readme_example(README)
