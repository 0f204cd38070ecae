"""The plugin catalog: schema, agreement with each package, generated docs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import catalog
import pytest

GOOD_ENTRY = """
[[plugin]]
name = "demo"
distribution = "spore-demo"
import = "spore_demo"
path = "packages/demo"
version = "0.1.0"
core = ">=0.1,<0.2"
summary = "A demo plugin"
session = "tests(demo)"
smoke = "spore plugins check demo"
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def _package(root: Path, *, version: str = "0.1.0", core: str = ">=0.1,<0.2", ep: str = "demo"):
    _write(
        root / "packages/demo/pyproject.toml",
        f"""
        [project]
        name = "spore-demo"
        dynamic = ["version"]
        dependencies = ["spore-core{core}", "torch>=2.13"]

        [project.entry-points."spore.plugins"]
        {ep} = "spore_demo.plugin"

        [tool.setuptools.dynamic]
        version = {{ attr = "spore_demo._version.__version__" }}
        """,
    )
    _write(root / "packages/demo/src/spore_demo/_version.py", f'__version__ = "{version}"\n')


def test_the_real_catalog_is_valid_and_agrees_with_the_packages() -> None:
    entries = catalog.load()
    assert catalog.check_packages(entries) == []
    folders = sorted(p.name for p in (catalog.ROOT / "packages").iterdir() if p.is_dir())
    in_packages = [e for e in entries if e.path.startswith("packages/")]
    assert sorted(Path(e.path).name for e in in_packages) == folders
    for e in entries:  # kernels/ lives at the top level (docs/architecture.md, Layout)
        assert (catalog.ROOT / e.path / "pyproject.toml").exists(), e.path


def test_a_matching_package_passes(tmp_path: Path) -> None:
    entries = catalog.load(_write(tmp_path / "plugins.toml", GOOD_ENTRY))
    _package(tmp_path)
    assert [e.name for e in entries] == ["demo"]
    assert catalog.check_packages(entries, tmp_path) == []


def test_disagreements_are_all_reported(tmp_path: Path) -> None:
    entries = catalog.load(_write(tmp_path / "plugins.toml", GOOD_ENTRY))
    _package(tmp_path, version="0.2.0", core=">=0.1,<0.3", ep="other")
    _write(tmp_path / "packages/stray/pyproject.toml", '[project]\nname = "stray"\n')
    problems = catalog.check_packages(entries, tmp_path)
    assert problems == [
        "packages/stray: package is not listed in plugins_registry/plugins.toml",
        "demo: version '0.1.0' in the catalog, '0.2.0' in package",
        "demo: no 'spore.plugins' entry point named 'demo'",
        "demo: core range '>=0.1,<0.2' in the catalog, '<0.3,>=0.1' in pyproject",
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('version = "0.1.0"\n', ""), "missing ['version']"),
        (lambda t: t + 'color = "red"\n', "unknown keys ['color']"),
        (lambda t: t.replace('"tests(demo)"', '"demo"'), "session must be 'tests(demo)'"),
        (lambda t: t.replace('"spore plugins check demo"', '" "'), "smoke must be a command"),
        (lambda t: t.replace('name = "demo"', 'name = "Demo!"'), "name must be lower-case"),
        (lambda t: t.replace('version = "0.1.0"', "version = 1"), "must be strings"),
        (lambda t: t + t, "plugin name 'demo' appears twice"),
        (lambda t: "oops = [", "not valid TOML"),
    ],
)
def test_schema_errors(tmp_path: Path, edit, message) -> None:
    path = _write(tmp_path / "plugins.toml", edit(GOOD_ENTRY))
    with pytest.raises(catalog.CatalogError) as info:
        catalog.load(path)
    assert message in str(info.value)


def test_generated_docs_are_fresh() -> None:
    entries = catalog.load()
    compatibility = (catalog.ROOT / "docs/compatibility.md").read_text()
    assert compatibility == catalog.render_compatibility(entries), (
        "docs/compatibility.md is stale: run `python plugins_registry/catalog.py render`"
    )
    readme = (catalog.ROOT / "README.md").read_text()
    assert readme == catalog.render_readme(readme, entries), (
        "the plugin table in README.md is stale: run `python plugins_registry/catalog.py render`"
    )


def test_every_package_link_of_the_generated_pages_resolves() -> None:
    """docs/compatibility.md linked kernels as ``(kernels)``, a folder docs/ does not have."""
    import re

    entries = catalog.load()
    pages = {
        catalog.ROOT / "README.md": catalog.render_table(entries),
        catalog.ROOT / "docs/compatibility.md": catalog.render_compatibility(entries),
    }
    for page, text in pages.items():
        links = re.findall(r"\| \[[^]]+\]\(([^)]+)\)", text)
        assert len(links) == len(entries)
        for link in links:
            assert (page.parent / link).is_dir(), f"{page.name}: {link}"


def test_rendered_table_lists_each_entry(tmp_path: Path) -> None:
    entries = catalog.load(_write(tmp_path / "plugins.toml", GOOD_ENTRY))
    table = catalog.render_table(entries)
    assert "| [demo](packages/demo) | `spore-demo` | `spore_demo` | 0.1.0 |" in table
    assert "](../packages/demo)" in catalog.render_compatibility(entries)
    with pytest.raises(catalog.CatalogError, match="lacks the markers"):
        catalog.render_readme("# no markers\n", entries)
