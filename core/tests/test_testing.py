from __future__ import annotations

import sys

import pytest

from spore import childproc
from spore.plugins import PluginError, Status, get_manager
from spore.testing import check_plugin_contract, clean_environ


def test_contract_passes_for_a_healthy_plugin(fixture_plugins) -> None:
    fixture_plugins("healthy", "broken")
    info = check_plugin_contract("healthy")
    assert info.status is Status.ACTIVE
    assert info.registered["benchmarks"] == ["sleep"]


def test_contract_fails_for_a_plugin_that_conflicts_with_another(fixture_plugins) -> None:
    fixture_plugins("dup_a")
    assert check_plugin_contract("dup-a").status is Status.ACTIVE
    fixture_plugins("dup_b")
    with pytest.raises(AssertionError, match=r"'dup-b' is failed beside the other installed"):
        check_plugin_contract("dup-b")


def test_contract_fails_for_a_plugin_that_does_not_load(fixture_plugins) -> None:
    fixture_plugins("broken")
    with pytest.raises(PluginError, match=r"libspore_fixture\.so"):
        check_plugin_contract("broken")


def test_contract_fails_for_a_plugin_that_registers_nothing(fixture_plugins) -> None:
    fixture_plugins("reentrant")
    with pytest.raises(AssertionError, match="registered nothing"):
        check_plugin_contract("reentrant")


def test_contract_fails_when_not_installed() -> None:
    with pytest.raises(AssertionError, match="no entry point named 'absent'"):
        check_plugin_contract("absent")


def test_spore_manager_fixture_isolates_the_global_manager(
    fixture_plugins, spore_manager, monkeypatch
) -> None:
    fixture_plugins("healthy")
    monkeypatch.setenv("SPORE_NO_PLUGINS", "1")
    manager = spore_manager()
    assert get_manager() is manager
    assert {i.name: i.status for i in manager.plugins()}["healthy"] is Status.ACTIVE


RUN_SPORE_TESTS = """
import json
import os
import sys


def test_strips_spore_variables_and_adds_env(run_spore, monkeypatch):
    monkeypatch.setenv("SPORE_NO_PLUGINS", "1")
    path = os.pathsep.join([os.environ["FIXTURE_HEALTHY"], os.environ.get("PYTHONPATH", "")])
    out = run_spore("plugins", "--json", env={"PYTHONPATH": path})
    assert out.returncode == 0, out.stderr
    assert {r["name"]: r["status"] for r in json.loads(out.stdout)}["healthy"] == "active"


def test_runs_in_a_fresh_directory_unless_told(run_spore, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cwd = ("run", "-q", "--", sys.executable, "-c", "import os; print(os.getcwd())")
    fresh = run_spore(*cwd).stdout.strip()
    assert fresh != str(tmp_path) and os.path.isdir(fresh) and not os.listdir(fresh)
    assert run_spore(*cwd, cwd=tmp_path).stdout.strip() == str(tmp_path)


def test_a_timeout_fails_the_test_naming_the_command(run_spore):
    run_spore("doctor", timeout=0.01)
"""


def test_run_spore_fixture(tmp_path, fixtures_dir) -> None:
    (tmp_path / "test_uses_run_spore.py").write_text(RUN_SPORE_TESTS)
    env = clean_environ({"FIXTURE_HEALTHY": str(fixtures_dir / "healthy")})
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", tmp_path]
    done = childproc.run([*map(str, command), str(tmp_path)], env=env, timeout=600, check=False)
    assert "2 passed, 1 failed" in done.stdout or "1 failed, 2 passed" in done.stdout, done.stdout
    assert "-m spore doctor` did not finish within 0.01s (killed)" in done.stdout


def test_spore_plugin_source_makes_a_discoverable_plugin(spore_plugin_source, spore_manager):
    spore_plugin_source(
        "from-source",
        "import spore\n\n@spore.hookimpl\ndef spore_doctor(report):\n"
        "    report.add('x', 'ok', 'y')\n",
    )
    manager = spore_manager({"SPORE_PLUGINS": "from-source"})
    (info,) = [i for i in manager.plugins() if i.name == "from-source"]
    assert info.status.value == "active"
    assert info.version == "0.1.0"
    assert "spore_test_plugin_from_source" in sys.modules


def test_run_readme_example_runs_the_use_block_in_a_fresh_folder(run_readme_example, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        "# p\n\n## Use\n\n```python\nimport os\nprint('cwd', os.getcwd())\n```\n\n"
        "## Other\n\n```python\nprint('other')\n```\n"
    )
    shown = run_readme_example(readme)
    assert shown == f"cwd {tmp_path}\n"
    assert run_readme_example(readme, section="Other") == "other\n"


def test_run_readme_example_fails_without_the_block(run_readme_example, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# p\n\n## Use\n\nno code here\n")
    with pytest.raises(pytest.fail.Exception, match="lacks the python example under ## Use"):
        run_readme_example(readme)
