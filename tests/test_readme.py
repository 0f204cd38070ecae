"""The README's two commands: CI runs the test one; the set-up one works in a fresh venv."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import catalog


def _block_after(marker: str) -> str:
    readme = (catalog.ROOT / "README.md").read_text()
    found = re.search(re.escape(marker) + r"\n```bash\n(.*?)\n```", readme, re.S)
    assert found, f"README.md has no bash block after {marker}"
    return found.group(1)


def test_ci_runs_the_readme_test_command() -> None:
    out = subprocess.run(
        ["bash", str(catalog.ROOT / ".ci/run")],
        env=dict(os.environ, CI_PRINT_COMMAND="1"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == _block_after("<!-- ci:test -->")
    assert "nox" in out.stdout


def test_setup_command_works_in_a_fresh_venv(tmp_path) -> None:
    command = _block_after("<!-- ci:setup -->")
    checkout = tmp_path / "checkout"
    shutil.copytree(
        catalog.ROOT,
        checkout,
        ignore=shutil.ignore_patterns(".git", ".venv", ".nox", "*.egg-info", "build"),
    )
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["COLUMNS"] = "160"
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "spore doctor" in out.stdout
    assert "2.13.0" in out.stdout
    assert "mccl" in out.stdout
    assert "spore-kernels" in out.stdout
    assert (checkout / ".venv/bin/spore").exists()
    assert "spore train: summary" in out.stdout
    assert (checkout / "runs/default/final/model.safetensors").is_file()
