"""The runnable example of docs/mfusion-region-compilers.md runs, in a fresh interpreter."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from spore import childproc
from spore.testing import clean_environ

PAGE = Path(__file__).resolve().parents[3] / "docs" / "mfusion-region-compilers.md"


def test_the_example_runs(tmp_path: Path, inductor_cache: str) -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = clean_environ({"TORCHINDUCTOR_CACHE_DIR": inductor_cache})
    env.pop("MFUSION_CPU", None)  # the example asks for what it needs, as a user's script would
    done = childproc.run([sys.executable, str(script)], env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0
