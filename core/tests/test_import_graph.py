"""No module of ``spore`` imports, directly or through others, a module that imports it back.

What counts as an import of module ``A`` by module ``B`` (anywhere in ``B``: module level, inside
functions and methods, under ``try``), read with :mod:`ast` without importing anything:

- ``import spore.a`` and ``from spore.a import x`` (relative forms resolved);
- ``from spore import x``: of ``spore.x`` when ``x`` is a submodule, else of ``spore`` itself;
- ``importlib.import_module("spore.a")`` with a literal name;
- in ``spore/__init__.py``, the modules named by ``_LAZY`` (imported on attribute access).

Not counted: imports under ``if TYPE_CHECKING:`` (never run), and the parent packages Python
initialises before a submodule (``spore/__init__.py`` imports no submodule at import time
except those listed in ``test_package_init_imports_only_leaves``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "spore"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that can run (``if TYPE_CHECKING:`` bodies left out)."""
    found: list[ast.AST] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _lazy_table(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            return sorted(set(value.values()))
    return []


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The ``spore`` modules that ``module`` imports (see the module docstring for the rules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    if module == PACKAGE:
        found.update(_lazy_table(tree))
    return {m for m in found if m in known and m != module}


def import_graph() -> dict[str, set[str]]:
    """``module -> the spore modules it imports`` for every module of the package."""
    modules = _modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_spore_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 10, f"found only {sorted(graph)} under {SRC}"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


MECHANISMS = ("spore.dispatch", "spore.graph_passes", "spore.backends", "spore.bench")
"""They receive their registry; :mod:`spore.registry` feeds them and must not reach it either."""


@pytest.mark.parametrize("mechanism", [*MECHANISMS, "spore.registry"])
def test_mechanisms_never_import_the_plugin_manager(mechanism: str) -> None:
    graph = import_graph()
    reachable: set[str] = set()
    stack = [mechanism]
    while stack:
        for nxt in graph[stack.pop()] - reachable:
            reachable.add(nxt)
            stack.append(nxt)
    manager_side = {m for m in graph if m == "spore.plugins" or m.startswith("spore.plugins.")}
    assert not reachable & (manager_side | {PACKAGE}), (
        f"{mechanism} reaches {sorted(reachable & (manager_side | {PACKAGE}))}; a mechanism "
        f"receives its registry and never asks for the plugin manager"
    )


def test_package_init_imports_only_leaves() -> None:
    """What ``spore/__init__.py`` imports at import time imports no other spore module."""
    graph = import_graph()
    tree = ast.parse((SRC / PACKAGE / "__init__.py").read_text())
    eager = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    eager = {m for m in eager if m and m.startswith(f"{PACKAGE}.")}
    assert all(not graph[m] for m in eager), {m: graph[m] for m in eager}


def test_the_checker_finds_a_function_level_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "spore"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('_LAZY = {"thing": "spore.a"}\n')
    (pkg / "a.py").write_text("def f():\n    from spore import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import spore.a\n"
        "def g():\n    import importlib\n    importlib.import_module('spore.c')\n"
    )
    (pkg / "c.py").write_text("from . import a\n")
    known = {"spore", "spore.a", "spore.b", "spore.c"}
    graph = {
        name: imports_of(name, pkg / (f"{name[6:] or '__init__'}.py"), known) for name in known
    }
    assert graph == {
        "spore": {"spore.a"},
        "spore.a": {"spore.b"},
        "spore.b": {"spore.c"},
        "spore.c": {"spore.a"},
    }
    assert find_cycle(graph) == ["spore.a", "spore.b", "spore.c", "spore.a"]
