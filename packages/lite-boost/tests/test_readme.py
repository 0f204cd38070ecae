"""The package README: its usage example runs."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_usage_example_runs(tmp_path, monkeypatch, capsys) -> None:
    block = re.search(r"## Use\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md lacks the python example under ## Use"
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(script), run_name="__main__")
    assert "runs lite-boost:sdpa" in capsys.readouterr().out
