"""Spore's test sessions: lint, core, tests(<package>) per catalog entry, integration, bench.

Every install uses `-c constraints.txt`, so torch resolves to the 2.13.0 CPU build.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "plugins_registry"))
import catalog  # noqa: E402

PACKAGES = {e.name: e for e in catalog.load()}
CONSTRAINTS = ("-c", "constraints.txt")
LOCAL = {"spore-core": "core", "spore-kernels": "kernels"} | {
    e.distribution: e.path for e in PACKAGES.values()
}

nox.options.error_on_missing_interpreters = True


def _local_closure(path: str) -> list[str]:
    """``path`` and every local package it depends on, dependencies first."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    order: list[str] = []

    def visit(p: str) -> None:
        if p in order:
            return
        project = tomllib.loads((ROOT / p / "pyproject.toml").read_text())["project"]
        for dep in project.get("dependencies", []):
            local = LOCAL.get(canonicalize_name(Requirement(dep).name))
            if local:
                visit(local)
        order.append(p)

    visit(path)
    return [f"./{p}" for p in order]


def _all_packages() -> list[str]:
    """Every catalog package and its local dependencies, each once, dependencies first."""
    paths: list[str] = []
    for entry in PACKAGES.values():
        paths += [p for p in _local_closure(entry.path) if p not in paths]
    return paths


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and the plugin catalog check."""
    session.install(*CONSTRAINTS, "ruff", "packaging")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "plugins_registry/catalog.py", "check")


@nox.session
def core(session: nox.Session) -> None:
    """spore-core alone: its unit and CLI tests."""
    session.install(*CONSTRAINTS, "./core[test]")
    session.run("pytest", "core/tests", *session.posargs)


@nox.session
@nox.parametrize("package", sorted(PACKAGES), ids=sorted(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One plugin package alone: only spore-core, the package and its declared dependencies."""
    entry = PACKAGES[package]
    *deps, target = _local_closure(entry.path)
    session.install(*CONSTRAINTS, *deps, f"{target}[test]")
    session.run("pytest", f"{entry.path}/tests", *session.posargs)


@nox.session
def integration(session: nox.Session) -> None:
    """Everything installed together: catalog, docs, README commands and CLI end to end."""
    session.install(*CONSTRAINTS, "./core[test]", *_all_packages())
    session.run("pytest", "tests", *session.posargs)


@nox.session(default=False)
def mindspore(session: nox.Session) -> None:
    """The MindSpore frontend against MindSpore 2.10 (CPU wheel, ~3 GB; not run by default).

    MindSpore needs numpy<2, which constraints.txt does not allow, so torch is pinned here.
    """
    session.install("torch==2.13.0", "mindspore==2.10.0", "numpy<2", "./core[test]")
    session.run("pytest", "core/tests_mindspore", *session.posargs)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every registered benchmark (not run by default): `nox -s bench -- [PLUGIN...] [--json]`."""
    session.install(*CONSTRAINTS, "./core", *_all_packages())
    session.run("spore", "bench", *session.posargs)
