from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "plugins"
FIXTURE_MODULES = ("spore_fixture_", "torch_npu")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "core_alone: checks whole listings of plugins, backends, commands or ops, so needs "
        "spore-core without installed plugins (as `nox -s core` installs it)",
    )


@pytest.fixture(autouse=True)
def _core_alone(request: pytest.FixtureRequest) -> None:
    """A ``core_alone`` test fails at once, saying why, where plugins are installed (a venv
    holding every package): its listings would hold theirs too."""
    if request.node.get_closest_marker("core_alone") is None:
        return
    from spore.discovery import ENTRY_POINT_GROUP

    installed = sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})
    if installed:
        pytest.fail(
            f"this test compares whole listings and needs spore-core alone, but plugins are "
            f"installed here ({', '.join(installed)}): run `nox -s core`, or pytest in a venv "
            f"with only `pip install -c constraints.txt ./core[test]`",
            pytrace=False,
        )


def _forget_fixture_modules() -> None:
    for name in [m for m in sys.modules if m.startswith(FIXTURE_MODULES)]:
        del sys.modules[name]


@pytest.fixture
def fixture_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Put fixture plugin distributions (real dist-info folders) on sys.path."""
    _forget_fixture_modules()

    def use(*names: str) -> None:
        for name in names:
            monkeypatch.syspath_prepend(str(FIXTURES / name))
        importlib.invalidate_caches()

    yield use
    _forget_fixture_modules()


@pytest.fixture
def fixtures_dir() -> Path:
    """The folder of fixture plugin distributions."""
    return FIXTURES


@pytest.fixture
def run_spore(run_spore: Callable[..., subprocess.CompletedProcess[str]]) -> Callable[..., Any]:
    """spore.testing's ``run_spore``, with only the fixture plugins named in ``plugins=``."""

    def run(
        *args: str,
        plugins: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        child_env = {"PYTHONPATH": os.pathsep.join(str(FIXTURES / p) for p in plugins)}
        child_env["COLUMNS"] = "200"
        child_env.update(env or {})
        return run_spore(*args, env=child_env, timeout=240, cwd=cwd)

    return run
