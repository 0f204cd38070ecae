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
    """Without ``-m``, deselect the ``setup_command`` test (``-m setup_command`` runs it)."""
    if config.option.markexpr:
        return
    chosen = [item for item in items if not item.get_closest_marker("setup_command")]
    if len(chosen) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in chosen])
        items[:] = chosen
