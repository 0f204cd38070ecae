"""Test support for Spore plugins: a pytest plugin (entry point ``pytest11``) and the contract.

Fixtures:

``spore_manager``
    factory ``make(env=None, requested=(), strict=None) -> PluginManager``: a fresh manager that
    reads the current ``sys.path`` and ignores the caller's ``SPORE_*`` variables, installed as
    the process-wide manager for the rest of the test.
``spore_plugin_contract``
    :func:`check_plugin_contract`, for ``spore_plugin_contract("myplugin")``.
``spore_plugin_source``
    ``add(name, source)``: a plugin distribution ``name`` (version 0.1.0, entry point
    ``name = <module>``) whose module holds ``source``, put on ``sys.path`` for the test; its
    module is forgotten afterwards. Use ``spore_manager`` after it so discovery sees it.
``run_readme_example``
    ``run(readme, section="Use") -> str``: runs the python block that opens ``## <section>`` of
    the Markdown file ``readme`` as ``__main__`` in a fresh temporary working directory and
    returns what it printed; fails the test when there is no such block.
``run_spore``
    ``run_spore(*args, env=None, timeout=120, cwd=None) -> CompletedProcess[str]``: the ``spore``
    command line in a child process (``python -m spore ARGS``) with captured text output. The
    child's environment is this one without ``SPORE_*`` variables, updated with ``env``; its
    working directory is a fresh temporary one unless ``cwd`` is given. A child that runs past
    ``timeout`` seconds is killed and fails the test, showing the command and its output.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

try:
    import pytest
except ImportError as exc:
    raise ImportError(
        "spore.testing is a pytest plugin and needs pytest: pip install 'spore-core[test]' "
        "(or pip install pytest)"
    ) from exc

from spore import childproc
from spore.plugins import (
    ENTRY_POINT_GROUP,
    PluginInfo,
    PluginManager,
    Status,
    normalize,
    use_manager,
)

LISTING_TIMEOUT_S = 300


def clean_environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without ``SPORE_*`` variables, updated with ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    base.update(env or {})
    return base


def isolated_manager(
    env: Mapping[str, str] | None = None,
    *,
    requested: Iterable[str] = (),
    strict: bool | None = None,
) -> PluginManager:
    """A new manager over ``os.environ`` without ``SPORE_*`` variables, updated with ``env``."""
    return PluginManager(clean_environ(env), requested=requested, strict=strict)


def _load_alone(name: str) -> PluginInfo:
    import click

    manager = isolated_manager({"SPORE_PLUGINS": name})
    group = click.Group("spore-contract")
    manager.add_commands(group)
    infos = {i.name: i for i in manager.plugins()}
    return infos[normalize(name)]


def _listed(name: str) -> dict[str, Any]:
    """Plugin ``name``'s row in ``spore plugins --json`` run by a fresh interpreter that sees
    this one's ``sys.path`` (every plugin installed here loads beside it)."""
    path = os.pathsep.join(p for p in sys.path if p)
    command = childproc.python("-m", "spore", "plugins", "--json")
    with tempfile.TemporaryDirectory(prefix="spore-contract-") as cwd:
        done = childproc.run(
            command, env=clean_environ({"PYTHONPATH": path}), cwd=cwd, timeout=LISTING_TIMEOUT_S
        )
    rows = {row["name"]: row for row in json.loads(done.stdout)}
    assert normalize(name) in rows, f"`spore plugins --json` does not list {name!r}: {list(rows)}"
    return rows[normalize(name)]


def check_plugin_contract(name: str) -> PluginInfo:
    """Assert that plugin ``name`` keeps the Spore plugin contract; return its info.

    The plugin must be discoverable through a ``spore.plugins`` entry point, declare a
    ``spore-core`` range that the running core satisfies, load alone and become active,
    register something (an op, pass, backend, benchmark or command, or a doctor check), load
    again in a second manager with the same result, and be listed active by ``spore plugins``
    in a fresh interpreter beside every other installed plugin, registering the same names.
    """
    key = normalize(name)
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if normalize(ep.name) == key]
    assert eps, f"no entry point named {name!r} in group {ENTRY_POINT_GROUP!r}; is it installed?"
    first = _load_alone(name)
    assert first.status is Status.ACTIVE, f"plugin {name!r} is {first.status}: {first.reason}"
    assert first.core_requirement is not None, (
        f"{first.distribution} does not declare a spore-core requirement in its dependencies"
    )
    doctor_only = "spore_doctor" in first.hooks
    assert any(first.registered.values()) or doctor_only, (
        f"plugin {name!r} is active but registered nothing (hooks: {first.hooks})"
    )
    second = _load_alone(name)
    assert second.status is Status.ACTIVE, (
        f"plugin {name!r} failed when loaded a second time: {second.reason}"
    )
    assert second.registered == first.registered, (
        f"plugin {name!r} registered {second.registered} the second time, {first.registered} "
        f"the first"
    )
    listed, alone = _listed(name), first.to_dict()["registered"]
    assert listed["status"] == Status.ACTIVE.value, (
        f"plugin {name!r} is {listed['status']} beside the other installed plugins: "
        f"{listed['reason']}"
    )
    assert listed["registered"] == alone, (
        f"plugin {name!r} registered {listed['registered']} beside the other installed plugins, "
        f"{alone} alone"
    )
    return first


class ManagerFactory(Protocol):
    def __call__(
        self,
        env: Mapping[str, str] | None = ...,
        *,
        requested: Iterable[str] = ...,
        strict: bool | None = ...,
    ) -> PluginManager: ...


@pytest.fixture
def spore_manager() -> Iterator[ManagerFactory]:
    """Factory for isolated plugin managers (see the module docstring)."""
    with ExitStack() as stack:

        def make(
            env: Mapping[str, str] | None = None,
            *,
            requested: Iterable[str] = (),
            strict: bool | None = None,
        ) -> PluginManager:
            manager = isolated_manager(env, requested=requested, strict=strict)
            stack.enter_context(use_manager(manager))
            return manager

        yield make


@pytest.fixture
def spore_plugin_source(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """Writes plugin distributions from source (see the module docstring)."""
    import importlib

    root = tmp_path_factory.mktemp("spore_plugins")
    modules: list[str] = []
    monkeypatch.syspath_prepend(str(root))

    def add(name: str, source: str) -> None:
        module = f"spore_test_plugin_{normalize(name).replace('-', '_')}"
        (root / f"{module}.py").write_text(source)
        info = root / f"{name}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n"
            "Requires-Dist: spore-core>=0.1,<0.2\n"
        )
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {module}\n")
        modules.append(module)
        importlib.invalidate_caches()

    yield add
    for module in modules:
        sys.modules.pop(module, None)


@pytest.fixture
def run_readme_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> Any:
    """Runs a README's usage example (see the module docstring)."""

    def run(readme: Path, section: str = "Use") -> str:
        pattern = rf"## {re.escape(section)}\n\n```python\n(.*?)```"
        block = re.search(pattern, Path(readme).read_text(), re.S)
        if block is None:
            pytest.fail(f"{readme} lacks the python example under ## {section}")
        script = tmp_path / "readme_example.py"
        script.write_text(block.group(1))
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        runpy.run_path(str(script), run_name="__main__")
        return capsys.readouterr().out

    return run


@pytest.fixture
def spore_plugin_contract() -> Any:
    """:func:`check_plugin_contract`, as a fixture."""
    return check_plugin_contract


class SporeRunner(Protocol):
    def __call__(
        self,
        *args: str,
        env: Mapping[str, str] | None = ...,
        timeout: float = ...,
        cwd: os.PathLike[str] | str | None = ...,
    ) -> subprocess.CompletedProcess[str]: ...


@pytest.fixture
def run_spore(tmp_path_factory: pytest.TempPathFactory) -> SporeRunner:
    """Runs the ``spore`` command line in a child process (see the module docstring)."""
    default_cwd: Path | None = None

    def run(
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 120,
        cwd: os.PathLike[str] | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        nonlocal default_cwd
        if cwd is None:
            default_cwd = default_cwd or tmp_path_factory.mktemp("spore-cwd")
            cwd = default_cwd
        command = childproc.python("-m", "spore", *args)
        try:
            return childproc.run(
                command, env=clean_environ(env), timeout=timeout, cwd=cwd, check=False
            )
        except childproc.ChildError as exc:
            failure = str(exc)
        pytest.fail(failure, pytrace=False)

    return run
