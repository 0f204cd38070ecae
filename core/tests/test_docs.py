"""The runnable examples in docs/core/*.md run, each page in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs" / "core"
FRONTENDS = {"mindspore"}  # run by their own nox sessions (core/tests_mindspore)
PAGES = sorted(p for p in DOCS.glob("*.md") if p.stem not in FRONTENDS)


def test_every_core_mechanism_has_a_page() -> None:
    assert {p.stem for p in PAGES} >= {"dispatch", "fallback", "memory", "backends", "passes"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_examples_run(page: Path, tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    assert blocks, f"{page.name} has no python example"
    script = tmp_path / f"{page.stem}.py"
    script.write_text("\n\n".join(blocks))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, f"{page.name}:\n{out.stderr[-3000:]}"
