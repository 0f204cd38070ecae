"""A module of dvm as an earlier commit had it, for the A/B tools that time it beside the
current one in one process."""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from pathlib import Path
from types import ModuleType


def module(commit: str, name: str) -> ModuleType:
    """``dvm.<name>`` as of ``commit`` (read with ``git show``), imported as a module of its
    own, ``former_<name>``; run from the repository."""
    source = subprocess.run(
        ["git", "show", f"{commit}:packages/dvm/src/dvm/{name}.py"],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"former_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"former_{name}", path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    return loaded
