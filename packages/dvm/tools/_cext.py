"""The tools' own small C probes: a one-file CPython extension built with the system compiler
(``$CC``, else ``cc``) into a folder the caller puts on ``sys.path``."""

from __future__ import annotations

import os
import subprocess
import sysconfig
from pathlib import Path


def build(folder: Path, name: str, source: str) -> None:
    """Extension module ``name`` compiled from C ``source`` into ``folder``; SystemExit with the
    compiler's output when it does not build."""
    path = folder / f"{name}.c"
    path.write_text(source)
    target = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    cmd = [os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", f"-I{include}"]
    cmd += [str(path), "-o", str(target)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not build {name} ({' '.join(cmd)}):\n{done.stderr}")
