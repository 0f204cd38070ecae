"""Switching passes off and on: MFUSION_DISABLE, the Python API, and the versions they report."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import mfusion
from mfusion import selection
from mfusion.passes import all_passes


@pytest.fixture(autouse=True)
def clean_switches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(selection.ENV, raising=False)
    selection.reset()
    yield
    selection.reset()


def _some_pass() -> str:
    return mfusion.pass_names()[0]


def test_every_pass_has_a_unique_name_version_priority_and_summary() -> None:
    names = mfusion.pass_names()
    assert len(names) == len(set(names)) > 0
    for pass_ in all_passes():
        assert isinstance(pass_.name, str), pass_
        assert "." not in pass_.name, pass_
        assert isinstance(pass_.version, str), pass_
        assert pass_.version, pass_
        assert isinstance(pass_.priority, int), pass_
        assert isinstance(pass_.summary, str), pass_
        assert pass_.summary, pass_


def test_all_on_by_default() -> None:
    assert mfusion.disabled_passes() == []
    assert all(mfusion.is_enabled(n) for n in mfusion.pass_names())


def test_environment_switches_passes_off(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _some_pass()
    monkeypatch.setenv(selection.ENV, f" {name} ,")
    assert mfusion.disabled_passes() == [name]
    assert mfusion.is_enabled(f"mfusion.{name}") is False
    monkeypatch.setenv(selection.ENV, "all")
    assert mfusion.disabled_passes() == mfusion.pass_names()


def test_unknown_name_in_environment_warns_and_is_ignored(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(selection.ENV, "no_such_pass")
    with caplog.at_level(logging.WARNING, logger="mfusion"):
        assert mfusion.disabled_passes() == []
    assert "no_such_pass" in caplog.text
    assert selection.ENV in caplog.text


def test_api_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _some_pass()
    monkeypatch.setenv(selection.ENV, name)
    mfusion.enable_passes(name)
    assert mfusion.is_enabled(name)
    mfusion.disable_passes(f"mfusion.{name}")
    assert not mfusion.is_enabled(name)
    mfusion.enable_passes("all")
    assert mfusion.disabled_passes() == []


def test_unknown_name_in_api_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown mfusion pass 'ropee'.*the passes are"):
        mfusion.disable_passes("ropee")


def test_switched_pass_reports_another_version_and_does_nothing_when_off() -> None:
    pass_ = all_passes()[0]
    calls: list[object] = []

    class Recording:
        name = pass_.name
        version = "7"

        def __call__(self, gm: object) -> int:
            calls.append(gm)
            return 3

    switched = selection.Switched(Recording())
    assert (switched.version, switched(object())) == ("7", 3)
    mfusion.disable_passes(pass_.name)
    assert (switched.version, switched(object())) == ("7+off", 0)
    assert len(calls) == 1
