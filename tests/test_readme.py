"""The README's two commands: CI runs both, set-up first; the set-up one works in a fresh clone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import catalog
import pytest


def _block_after(marker: str) -> str:
    readme = (catalog.ROOT / "README.md").read_text()
    found = re.search(re.escape(marker) + r"\n```bash\n(.*?)\n```", readme, re.S)
    assert found, f"README.md has no bash block after {marker}"
    return found.group(1)


def _fresh_clone(dest: Path) -> None:
    """Copy what a clone of this checkout holds (files git tracks or does not ignore) to dest.

    Ignored paths stay behind: the user's .venv, build outputs and an earlier run's runs/.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=catalog.ROOT,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = catalog.ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_ci_runs_the_readme_setup_then_test_command() -> None:
    out = subprocess.run(
        ["bash", str(catalog.ROOT / ".ci/run")],
        env=dict(os.environ, CI_PRINT_COMMAND="1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    setup, test = _block_after("<!-- ci:setup -->"), _block_after("<!-- ci:test -->")
    assert out.stdout == f"{setup}\n{test}\n"
    assert "spore train" in setup
    assert "nox" in test


@pytest.mark.setup_command
def test_setup_command_works_in_a_fresh_venv(tmp_path) -> None:
    command = _block_after("<!-- ci:setup -->")
    checkout = tmp_path / "checkout"
    _fresh_clone(checkout)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["COLUMNS"] = "160"
    try:
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", command],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,  # installs and compiles every package: 15+ min on a busy 2-core machine
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.output or b"")[-3000:].decode(errors="replace")
        pytest.fail(
            f"the set-up command still ran after {exc.timeout:.0f} s; its output ends:\n{tail}"
        )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "spore doctor" in out.stdout
    assert "2.13.0" in out.stdout
    assert "mccl" in out.stdout
    assert "spore-kernels" in out.stdout
    assert (checkout / ".venv/bin/spore").exists()
    assert "spore train: summary" in out.stdout
    assert (checkout / "runs/default/final/model.safetensors").is_file()
