"""Each package imports, loads as a plugin and imports every module without the optional
packages it does not declare.

This venv holds every package's dependencies together, which hides an undeclared import: a
fresh interpreter per package blocks (``sys.modules[name] = None``) each optional package that
neither its dependencies nor those of the local packages it depends on provide. The package and
its plugin must load without its extras too; its modules may import an extra's packages (and
fail to import where that extra is not installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import catalog
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = {  # import name: distribution, for the third-party packages the packages use
    "diffusers": "diffusers",
    "hypothesis": "hypothesis",
    "matplotlib": "matplotlib",
    "numpy": "numpy",
    "protenix": "protenix",
    "psutil": "psutil",
    "pydantic": "pydantic",
    "pytest": "pytest",
    "safetensors": "safetensors",
    "scipy": "scipy",
    "transformers": "transformers",
    "triton": "triton",
    "yaml": "pyyaml",
}
ENTRIES = {e.name: e for e in catalog.load()}
LOCAL = {canonicalize_name(e.distribution): e.path for e in ENTRIES.values()} | {
    "spore-core": "core"
}

PROBE = """
import importlib, importlib.util, json, pkgutil, sys
name, package, blocked, extras = sys.argv[1:5]
blocked, extras = [m for m in blocked.split(",") if m], [m for m in extras.split(",") if m]
for module in blocked:
    sys.modules[module] = None
import click
from spore.plugins import PluginManager

importlib.import_module(package)
manager = PluginManager({"SPORE_PLUGINS": name}, strict=True)
manager.add_commands(click.Group("probe"))
info = {i.name: i for i in manager.plugins()}[name]
extras_loaded = sorted(m for m in extras if m in sys.modules)
root = importlib.import_module(package)
for module in pkgutil.walk_packages(root.__path__, package + "."):
    python = importlib.util.find_spec(module.name).origin.endswith(".py")  # not a ctypes .so
    if python and not module.name.endswith("__main__"):
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            if exc.name not in extras:  # a module for an extra that is not installed is fine
                raise
print(json.dumps({"status": info.status.value, "reason": info.reason, "extras": extras_loaded}))
"""


def _requirements(path: str, extras: bool) -> set[str]:
    """The distributions ``path``'s package requires (with its extras but ``test`` if
    ``extras``), and those the local packages it requires require, by canonical name."""
    project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
    deps = list(project.get("dependencies", []))
    if extras:
        for extra, more in project.get("optional-dependencies", {}).items():
            deps += more if extra != "test" else []
    names: set[str] = set()
    for dep in deps:
        req = canonicalize_name(Requirement(dep).name)
        names.add(req)
        if req in LOCAL:
            names |= _requirements(LOCAL[req], extras=False)
    return names


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_package_loads_without_the_optional_packages_it_does_not_declare(name: str) -> None:
    entry = ENTRIES[name]
    declared = _requirements(entry.path, extras=False)
    with_extras = _requirements(entry.path, extras=True)
    blocked = [m for m, dist in OPTIONAL.items() if dist not in with_extras]
    extras = [m for m, dist in OPTIONAL.items() if dist in with_extras - declared]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPORE_")}
    args = [name, entry.import_name, ",".join(blocked), ",".join(extras)]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, f"{name} without {blocked}:\n{out.stderr}"
    result = json.loads(out.stdout)
    assert result["status"] == "active", result["reason"]
    assert result["extras"] == [], f"loading {name} imported its extras' {result['extras']}"
