"""docs/writing-a-plugin.md is a working plugin: build it from the page, install it, use it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import catalog

from spore import childproc
from spore.testing import clean_environ


def _blocks(language: str) -> list[str]:
    page = (catalog.ROOT / "docs/writing-a-plugin.md").read_text()
    return [
        code for lang, code in re.findall(r"```(\w*)\n(.*?)```", page, re.S) if lang == language
    ]


def test_the_documented_plugin_installs_tests_and_runs(tmp_path: Path, run_spore) -> None:
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
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site)]
    childproc.run([*pip, str(package)], env=clean_environ(), timeout=600)
    env = {"PYTHONPATH": str(site)}

    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    tested = childproc.run(pytest, env=clean_environ(env), cwd=package, timeout=600, check=False)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "2 passed" in tested.stdout

    listed = run_spore("plugins", "--json", env=env, timeout=600)
    row = {r["name"]: r for r in json.loads(listed.stdout)}["hello"]
    assert row["status"] == "active"
    assert row["registered"] == {"benchmarks": ["square"], "commands": ["hello"]}

    assert run_spore("hello", "ada", env=env).stdout == "hello, ada\n"
    bench = run_spore(
        "bench", "hello", "--json", "--repeat", "1", "--min-time", "0", env=env, timeout=600
    )
    assert bench.returncode == 0, bench.stderr
    (result,) = json.loads(bench.stdout)["results"]
    assert result["error"] is None
    assert result["ratio"] > 0
