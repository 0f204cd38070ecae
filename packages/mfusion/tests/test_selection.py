"""Switching passes off and on: MFUSION_DISABLE, the Python API, and the versions they report."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import mfusion
import spore_kernels
from mfusion import selection
from mfusion.passes import all_passes


@pytest.fixture(autouse=True)
def clean_switches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(selection.ENV, raising=False)
    monkeypatch.delenv(selection.CPU_ENV, raising=False)
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
    selection._warn_unknown.cache_clear()
    monkeypatch.setenv(selection.ENV, "no_such_pass")
    with caplog.at_level(logging.WARNING, logger="mfusion"):
        assert mfusion.disabled_passes() == []
        assert mfusion.disabled_passes() == []  # read at every compile: warned once
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "no_such_pass" in caplog.text
    assert selection.ENV in caplog.text


def test_environment_names_are_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _some_pass()
    monkeypatch.setenv(selection.ENV, f"MFusion.{name.upper()}")
    assert mfusion.disabled_passes() == [name]
    monkeypatch.setenv(selection.ENV, "ALL")
    assert mfusion.disabled_passes() == mfusion.pass_names()


def test_api_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    name = _some_pass()
    monkeypatch.setenv(selection.ENV, name)
    mfusion.enable_passes(name)
    assert mfusion.is_enabled(name)
    mfusion.disable_passes(f"mfusion.{name}")
    assert not mfusion.is_enabled(name)
    mfusion.enable_passes("all")
    assert mfusion.disabled_passes() == []


def test_a_later_enable_wins_over_disabling_all() -> None:
    name, other = mfusion.pass_names()[:2]
    mfusion.disable_passes("all")
    mfusion.enable_passes(name)
    assert mfusion.is_enabled(name)
    assert not mfusion.is_enabled(other)
    assert name not in mfusion.disabled_passes()
    assert other in mfusion.disabled_passes()


def test_unknown_name_in_api_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"unknown mfusion pass 'ropee'.*the passes are"):
        mfusion.disable_passes("ropee")
    with pytest.raises(ValueError, match=r"unknown mfusion pass 'ropee'"):
        mfusion.is_enabled("ropee")  # it said True
    with pytest.raises(ValueError, match=r"'rope,gelu'.*pass each name as its own argument"):
        mfusion.disable_passes("rope,gelu")  # the environment's spelling
    for switch in (mfusion.disable_passes, mfusion.enable_passes, mfusion.is_enabled):
        for bad in (["rope", "gelu"], None, 3):  # AttributeError: no attribute 'strip'
            with pytest.raises(ValueError, match="mfusion pass names are strs"):
                switch(bad)


def test_switching_no_pass_is_an_error() -> None:
    """Both switched nothing, without a word (``disable_passes()`` meant for "all")."""
    for switch in (mfusion.disable_passes, mfusion.enable_passes):
        with pytest.raises(
            TypeError, match=rf"{switch.__name__}\(\) got no pass name.*'all'.*rope"
        ):
            switch()
    assert mfusion.disabled_passes() == []


def test_api_names_are_read_in_any_case() -> None:
    """As the environment's: disable_passes("RoPE") raised, and is_enabled("RoPE") said True
    after disable_passes("rope")."""
    name = _some_pass()
    mfusion.disable_passes(f"MFusion.{name.upper()}")
    assert not mfusion.is_enabled(name)
    assert not mfusion.is_enabled(name.upper())
    mfusion.enable_passes(name.title())
    assert mfusion.is_enabled(name.upper())


V7 = f"7+kernels{spore_kernels.__version__}"  # a version-7 pass's version, switched on


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
    assert (switched.version, switched(object())) == (V7, 3)
    mfusion.disable_passes(pass_.name)
    assert (switched.version, switched(object())) == (f"{V7}+off", 0)
    assert len(calls) == 1


CPU_OFF = {
    "autofuse", "rope", "add_rms_norm", "rms_norm", "layer_norm",
    "add_rms_norm_train", "rms_norm_train", "layer_norm_train",
}  # fmt: skip


def test_the_passes_left_to_inductor_on_cpu() -> None:
    """The README's list: the passes measured slower than Inductor's own kernels on CPU."""
    assert {p.name for p in all_passes() if not getattr(p, "on_cpu", True)} == CPU_OFF


def _graph(device: str | None) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(lambda x, n: x + n)
    x, n = gm.graph.find_nodes(op="placeholder")
    if device is not None:
        x.meta["val"] = torch.empty(2, device=device)
    n.meta["val"] = 3  # not a tensor: does not count
    return gm


def _recording(on_cpu: bool) -> tuple[selection.Switched, list[object]]:
    calls: list[object] = []
    name = sorted(CPU_OFF)[0]

    class Recording:
        version = "7"

        def __call__(self, gm: object) -> int:
            calls.append(gm)
            return 1

    Recording.name = name
    Recording.on_cpu = on_cpu
    return selection.Switched(Recording()), calls


def test_a_pass_that_does_not_pay_off_on_cpu_leaves_cpu_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    switched, calls = _recording(on_cpu=False)
    assert switched(_graph("cpu")) == 0
    assert calls == []
    assert switched(_graph("meta")) == 1  # another device
    # no tensor input: a CPU graph where there is no accelerator to make tensors on (as the
    # pass's uuid() assumes, so a graph it outlined could not be cached and served elsewhere)
    assert switched(_graph(None)) == int(torch.accelerator.is_available())
    assert switched.version == V7
    monkeypatch.setenv(selection.CPU_ENV, switched.name)
    assert (switched.version, switched(_graph("cpu"))) == (f"{V7}+cpu", 1)
    monkeypatch.setenv(selection.CPU_ENV, "all")
    assert selection.forced_on_cpu(switched.name)
    monkeypatch.delenv(selection.CPU_ENV)
    mfusion.enable_passes(switched.name)
    assert (switched.version, switched(_graph("cpu"))) == (f"{V7}+cpu", 1)
    mfusion.disable_passes(switched.name)
    assert (switched.version, switched(_graph("meta"))) == (f"{V7}+off", 0)


def test_a_pass_that_pays_off_on_cpu_runs_there() -> None:
    switched, calls = _recording(on_cpu=True)
    assert (switched.version, switched(_graph("cpu"))) == (V7, 1)
    assert len(calls) == 1


def test_by_default_a_cpu_rmsnorm_is_left_to_inductor(
    monkeypatch: pytest.MonkeyPatch, mfusion_compile, assert_rel_close
) -> None:
    """End to end on CPU: the RMSNorm stays decomposed by default and is rewritten when
    ``MFUSION_CPU`` names the pass; the SiLU gate is rewritten either way."""

    def block(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return torch.nn.functional.silu(h) * up

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(4, 64, generator=g), torch.randn(64, generator=g), torch.randn(4, 64)]
    default = mfusion_compile(block, *args)
    assert_rel_close(default.outputs, block(*args))
    assert default.spore_ops() == {"spore.silu_mul.default": 1}
    monkeypatch.setenv(selection.CPU_ENV, "rms_norm")
    forced = mfusion_compile(block, *args)
    assert forced.spore_ops() == {"spore.silu_mul.default": 1, "spore.rms_norm.default": 1}
