"""Everything installed together: every catalog plugin is active and keeps the contract."""

from __future__ import annotations

import json

import catalog

from spore.testing import check_plugin_contract


def test_installed_plugins_are_exactly_the_catalog_and_all_active(run_spore) -> None:
    entries = catalog.load()
    out = run_spore("plugins", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(rows) == {e.name for e in entries}
    for e in entries:
        assert rows[e.name]["status"] == "active", rows[e.name]
        assert rows[e.name]["version"] == e.version
        assert rows[e.name]["distribution"] == e.distribution
    check = run_spore("plugins", "check", timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def test_each_catalog_plugin_keeps_the_contract() -> None:
    checked = [check_plugin_contract(e.name).name for e in catalog.load()]
    assert checked == [e.name for e in catalog.load()]


def test_doctor_runs_with_everything_installed(run_spore) -> None:
    out = run_spore("doctor", "--json", "--quick", timeout=300)
    data = json.loads(out.stdout)
    names = {c["name"] for c in data["checks"]}
    assert {"python", "torch", "devices", "mindspore", "threads"} <= names
    assert out.returncode == (1 if data["worst"] == "error" else 0)
