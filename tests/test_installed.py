"""Everything installed together: every catalog plugin is active and keeps the contract."""

from __future__ import annotations

import json
import subprocess
import sys

import catalog

from spore.testing import check_plugin_contract


def _spore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spore", *args], capture_output=True, text=True, timeout=300
    )


def test_installed_plugins_are_exactly_the_catalog_and_all_active() -> None:
    entries = catalog.load()
    out = _spore("plugins", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {e.name for e in entries}
    for e in entries:
        assert rows[e.name]["status"] == "active", rows[e.name]
        assert rows[e.name]["version"] == e.version
        assert rows[e.name]["distribution"] == e.distribution
    check = _spore("plugins", "check")
    assert check.returncode == 0, check.stdout + check.stderr


def test_each_catalog_plugin_keeps_the_contract() -> None:
    checked = [check_plugin_contract(e.name).name for e in catalog.load()]
    assert checked == [e.name for e in catalog.load()]


def test_doctor_runs_with_everything_installed() -> None:
    out = _spore("doctor", "--json", "--quick")
    data = json.loads(out.stdout)
    names = {c["name"] for c in data["checks"]}
    assert {"python", "torch", "devices", "mindspore", "threads"} <= names
    assert out.returncode == (1 if data["worst"] == "error" else 0)
