"""docs/writing-a-plugin.md is a working plugin: build it from the page, install it, use it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import catalog


def _blocks(language: str) -> list[str]:
    page = (catalog.ROOT / "docs/writing-a-plugin.md").read_text()
    return [
        code for lang, code in re.findall(r"```(\w*)\n(.*?)```", page, re.S) if lang == language
    ]


def _run(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, capture_output=True, text=True, env=env, cwd=cwd, timeout=600, check=False
    )


def test_the_documented_plugin_installs_tests_and_runs(tmp_path: Path) -> None:
    (pyproject,) = _blocks("toml")
    version, plugin, tests = _blocks("python")
    package = tmp_path / "hello"
    (package / "src/spore_hello").mkdir(parents=True)
    (package / "tests").mkdir()
    (package / "pyproject.toml").write_text(pyproject)
    (package / "src/spore_hello/__init__.py").write_text("")
    (package / "src/spore_hello/_version.py").write_text(version)
    (package / "src/spore_hello/plugin.py").write_text(plugin)
    (package / "tests/test_plugin.py").write_text(tests)
    site = tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    install = _run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--target",
        str(site),
        str(package),
        env=env,
    )
    assert install.returncode == 0, install.stderr
    env["PYTHONPATH"] = str(site)

    tested = _run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", env=env, cwd=package
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "2 passed" in tested.stdout

    listed = _run(sys.executable, "-m", "spore", "plugins", "--json", env=env)
    row = {r["name"]: r for r in json.loads(listed.stdout)}["hello"]
    assert row["status"] == "active"
    assert row["registered"] == {"benchmarks": ["square"], "commands": ["hello"]}

    assert _run(sys.executable, "-m", "spore", "hello", "ada", env=env).stdout == "hello, ada\n"
    bench = _run(
        sys.executable,
        "-m",
        "spore",
        "bench",
        "hello",
        "--json",
        "--repeat",
        "1",
        "--min-time",
        "0",
        env=env,
    )
    assert bench.returncode == 0, bench.stderr
    (result,) = json.loads(bench.stdout)["results"]
    assert result["error"] is None
    assert result["ratio"] > 0
