"""Spore's sessions: lint, core, tests(<package>) per catalog entry, integration, protenix; and,
not run by default, mfusion_full, setup_command, mindspore, bench and build (the release
artifacts).

Every install uses `-c constraints.txt`, so torch resolves to the 2.13.0 CPU build.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import nox
from nox.virtualenv import VirtualEnv

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "plugins_registry"))
import catalog  # noqa: E402

PACKAGES = {e.name: e for e in catalog.load()}
CONSTRAINTS = ("-c", "constraints.txt")
CORE = "core"
LOCAL = {tomllib.loads((ROOT / CORE / "pyproject.toml").read_text())["project"]["name"]: CORE} | {
    e.distribution: e.path for e in PACKAGES.values()
}
DIST = ROOT / "dist"
WHEELHOUSE = ROOT / ".nox" / "wheelhouse"

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


def _fingerprint(path: str) -> str:
    """A digest of the files a build of ``path`` reads: those git tracks or would track."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard", "--", path],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    digest = hashlib.sha256()
    for name in sorted(n for n in listed.decode().split("\0") if n):
        file = ROOT / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:16]


def _wheel(session: nox.Session, path: str) -> str:
    """``path``'s wheel, built once per content of its files and shared by later sessions
    (the C++ packages take minutes to build)."""
    out = WHEELHOUSE / f"{Path(path).name}-{_fingerprint(path)}"
    if not any(out.glob("*.whl")):
        partial = out.with_name(out.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        wheel = ("python", "-m", "pip", "wheel", "-q", "--no-deps", *CONSTRAINTS)
        session.run(*wheel, "-w", str(partial), path)
        partial.rename(out)
    (wheel,) = out.glob("*.whl")
    return str(wheel)


def _install(session: nox.Session, *paths: str, test: str | None = None) -> None:
    """Install the local packages ``paths`` from their shared wheels; ``test`` (one of them)
    with its ``[test]`` extra."""
    wheels = [_wheel(session, p) + ("[test]" if p == test else "") for p in paths]
    session.install(*CONSTRAINTS, *wheels)


def _pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest ``args`` with TMPDIR in the session's own folder: pytest's tmp_path, the tests'
    child processes and Inductor's default cache (/tmp/torchinductor_<user>, never cleaned)
    all write there, so a run leaves nothing behind in the system's /tmp.

    When the tests pass and the venv is not kept for reuse (``-r``), the session's folder
    (venv and tmp) is removed: nox would recreate it on the next run anyway, and a full run
    would otherwise hold about 15 GB at its end. A failed session's folder stays for
    inspection."""
    session.create_tmp()
    session.run("pytest", *args, *session.posargs, env=env)
    venv = session.virtualenv
    if isinstance(venv, VirtualEnv) and not venv.reuse_existing:
        shutil.rmtree(venv.location)


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
    _pytest(session, "core/tests")


@nox.session
@nox.parametrize("package", sorted(PACKAGES), ids=sorted(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One plugin package alone: only spore-core, the package and its declared dependencies."""
    entry = PACKAGES[package]
    _install(session, *_local_closure(entry.path), test=f"./{entry.path}")
    _pytest(session, f"{entry.path}/tests")


@nox.session(default=False)
def mfusion_full(session: nox.Session) -> None:
    """mfusion's long model matrix (every model x forward/backward x fp32/bf16; not default)."""
    entry = PACKAGES["mfusion"]
    _install(session, *_local_closure(entry.path), test=f"./{entry.path}")
    _pytest(session, f"{entry.path}/tests", "-m", "slow")


@nox.session
def integration(session: nox.Session) -> None:
    """Everything installed together: catalog, docs, README commands and CLI end to end."""
    _install(session, *_all_packages(), test=f"./{CORE}")
    _pytest(session, "tests")


@nox.session(default=False)
def setup_command(session: nox.Session) -> None:
    """The README's set-up command in a fresh copy of the checkout (not default: CI runs it).

    CI runs that command itself, in a clean clone, before the tests."""
    session.install(*CONSTRAINTS, "./core[test]")
    _pytest(session, "tests/test_readme.py", "-m", "setup_command")


@nox.session(default=False)
def mindspore(session: nox.Session) -> None:
    """The MindSpore frontend against MindSpore 2.10 (CPU wheel, ~3 GB; not run by default).

    MindSpore needs numpy<2, which constraints.txt does not allow, so torch is pinned here.
    """
    session.install("torch==2.13.0", "mindspore==2.10.0", "numpy<2", "./core[test]")
    _pytest(session, "core/tests_mindspore")


@nox.session
def protenix(session: nox.Session) -> None:
    """sci-protenix's modules against Protenix's own with the same weights.

    Protenix pins an older torch, so it is installed without its dependencies, plus the few
    its model modules import; LAYERNORM_TYPE=torch keeps its layer norm off the CUDA extension.
    """
    entry = PACKAGES["sci-protenix"]
    _install(session, *_local_closure(entry.path), test=f"./{entry.path}")
    session.install(*CONSTRAINTS, "--no-deps", "protenix")
    session.install(*CONSTRAINTS, "rdkit", "optree", "ml-collections", "scipy")
    tests = f"{entry.path}/tests_protenix"
    _pytest(session, tests, env={"LAYERNORM_TYPE": "torch"})


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every registered benchmark (not run by default): `nox -s bench -- [PLUGIN...] [--json]`."""
    _install(session, *_all_packages())
    session.run("spore", "bench", *session.posargs)


def _tracked_sources(path: str) -> list[str]:
    """The files git tracks under ``path``'s src/ and csrc/: what its sdist must carry."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", f"{path}/src", f"{path}/csrc"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return [Path(name).relative_to(path).as_posix() for name in listed.decode().split("\0") if name]


def _build_package(session: nox.Session, path: str, out: Path) -> Path:
    """Build ``path``'s sdist, then its wheel from that sdist, into ``out``; return the wheel.

    Fails when the sdist lacks a tracked source file (C++ sources and headers included).
    """
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(out), path)  # the wheel from the sdist
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    with tarfile.open(sdist) as archive:
        carried = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = [name for name in _tracked_sources(path) if name not in carried]
    if missing:
        session.error(
            f"{sdist.name} lacks {missing}: add them to {path}'s package data/MANIFEST.in"
        )
    for artifact in (sdist, wheel):
        shutil.copy2(artifact, DIST / artifact.name)
    return DIST / wheel.name


def _smoke_test(session: nox.Session, entry: catalog.Entry, wheels: dict[str, Path]) -> None:
    """Install ``entry``'s wheel and its local dependencies' in a clean venv, run its smoke."""
    tmp = Path(session.create_tmp()).resolve()  # absolute: the smoke runs in another folder
    venv, work = tmp / "venv" / entry.name, tmp / "smoke" / entry.name
    for folder in (venv, work):
        shutil.rmtree(folder, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    ours = [wheels[p.removeprefix("./")] for p in _local_closure(entry.path)]
    session.run(python, "-m", "pip", "install", "-q", *CONSTRAINTS, *map(str, ours), external=True)
    listed = session.run(python, "-m", "pip", "list", "--format=json", silent=True, external=True)
    local = {row["name"] for row in json.loads(listed) if row["name"] in LOCAL}
    expected = {name for name, p in LOCAL.items() if f"./{p}" in _local_closure(entry.path)}
    if local != expected:
        session.error(f"{entry.name}'s venv holds {sorted(local)}, expected {sorted(expected)}")
    work.mkdir(parents=True)
    with session.chdir(work):
        _in_venv(session, venv, "bash", "-euo", "pipefail", "-c", entry.smoke)
        found = json.loads(_in_venv(session, venv, "spore", "plugins", "--json", silent=True))
    plugins = {e.name for e in PACKAGES.values() if f"./{e.path}" in _local_closure(entry.path)}
    if {row["name"] for row in found} != plugins:
        session.error(f"{entry.name}'s venv loads plugins {found}, expected only {plugins}")


def _in_venv(session: nox.Session, venv: Path, *args: str, silent: bool = False) -> str:
    """Run ``args`` with only ``venv`` on PATH and none of this shell's variables (env -i)."""
    keep = [f"{k}={os.environ[k]}" for k in ("HOME", "LANG", "TMPDIR") if k in os.environ]
    path = f"PATH={venv / 'bin'}:{os.defpath}"
    command = ("env", "-i", path, f"VIRTUAL_ENV={venv}", *keep, *args)
    return session.run(*command, silent=silent, external=True) or ""


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Release artifacts (not run by default): an sdist and a wheel per package in dist/.

    Each wheel is built from its sdist; twine checks the metadata; then each catalog plugin is
    installed from its own wheels (and spore-core's, and those of the local packages it
    declares) in a clean venv, and its catalog smoke command proves it works alone.
    """
    session.install(*CONSTRAINTS, "build", "twine")
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    out = Path(session.create_tmp()) / "dist"
    paths = [CORE] + [p.removeprefix("./") for p in _all_packages() if p != f"./{CORE}"]
    wheels = {path: _build_package(session, path, out / path) for path in paths}
    session.run("twine", "check", "--strict", *sorted(map(str, DIST.iterdir())))
    for entry in PACKAGES.values():
        _smoke_test(session, entry, wheels)
