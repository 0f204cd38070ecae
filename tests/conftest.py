from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "plugins_registry"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "setup_command: runs the README's set-up command in a fresh copy (minutes); run by "
        "`nox -s setup_command`, not by default (CI runs that command itself first)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the ``setup_command`` test unless ``-m`` names that marker or the test is
    named on the command line (``tests/test_readme.py::test_setup_command_works...``)."""
    if "setup_command" in (config.option.markexpr or ""):
        return
    named = {arg.partition("::")[2] for arg in config.args if "::" in arg}
    chosen = [i for i in items if not i.get_closest_marker("setup_command") or i.name in named]
    if len(chosen) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in chosen])
        items[:] = chosen
