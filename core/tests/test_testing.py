from __future__ import annotations

import pytest

from spore.plugins import PluginError, Status, get_manager
from spore.testing import check_plugin_contract


def test_contract_passes_for_a_healthy_plugin(fixture_plugins) -> None:
    fixture_plugins("healthy", "broken")
    info = check_plugin_contract("healthy")
    assert info.status is Status.ACTIVE
    assert info.registered["benchmarks"] == ["sleep"]


def test_contract_fails_for_a_plugin_that_does_not_load(fixture_plugins) -> None:
    fixture_plugins("broken")
    with pytest.raises(PluginError, match=r"libspore_fixture\.so"):
        check_plugin_contract("broken")


def test_contract_fails_for_a_plugin_that_registers_nothing(fixture_plugins) -> None:
    fixture_plugins("reentrant")
    with pytest.raises(AssertionError, match="registered nothing"):
        check_plugin_contract("reentrant")


def test_contract_fails_when_not_installed() -> None:
    with pytest.raises(AssertionError, match="no entry point named 'absent'"):
        check_plugin_contract("absent")


def test_spore_manager_fixture_isolates_the_global_manager(
    fixture_plugins, spore_manager, monkeypatch
) -> None:
    fixture_plugins("healthy")
    monkeypatch.setenv("SPORE_NO_PLUGINS", "1")
    manager = spore_manager()
    assert get_manager() is manager
    assert [i.status for i in manager.plugins()] == [Status.ACTIVE]
