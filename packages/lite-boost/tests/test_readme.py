"""The package README: its usage example and its booster example run."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

from lite_boost import boosters

README = Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(run_readme_example) -> None:
    assert "runs lite-boost:sdpa" in run_readme_example(README)


def test_booster_example_runs(tmp_path: Path) -> None:
    """The example of a booster of one's own defines its model class and asserts that the boost
    ran (it used MyVideoDiT without defining it); its booster is unregistered after."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (example,) = [block for block in blocks if "@lite_boost.register_booster(" in block]
    script = tmp_path / "booster_example.py"
    script.write_text(example)
    try:
        names = runpy.run_path(str(script), run_name="__main__")
    finally:
        boosters._python.boosters.pop("MyVideoDiT", None)
    assert names["model"].sparsity == 0.75
