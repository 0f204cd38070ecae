"""Automatic fusion end to end: region compilers from a real plugin distribution (through the
``mfusion_register_region_compilers`` hook) and from the Python API, in
``torch.compile(fn, backend="spore")`` forward and forward+backward, against eager."""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from mfusion.autofuse import region_compilers, register_region_compiler
from mfusion.autofuse.eager import EagerRegionCompiler
from spore.plugins import ENTRY_POINT_GROUP, PluginError

REGION = "mfusion_regions."  # the namespace of outlined region ops

MODULE = "spore_test_plugin_"  # how spore_plugin_source names the plugin modules

PLUGIN_SOURCE = textwrap.dedent(
    """
    import spore
    from mfusion.autofuse.eager import EagerRegionCompiler

    COMPILER = EagerRegionCompiler("from-plugin")


    @spore.hookimpl(optionalhook=True)
    def mfusion_register_region_compilers(registry):
        registry.add(COMPILER)


    @spore.hookimpl
    def spore_doctor(report):
        pass
    """
)
BROKEN_SOURCE = textwrap.dedent(
    """
    import spore


    @spore.hookimpl(optionalhook=True)
    def mfusion_register_region_compilers(registry):
        raise RuntimeError("cannot find the fused-kernel library")


    @spore.hookimpl
    def spore_doctor(report):
        pass
    """
)
# "aregions" sorts before "mfusion": it is registered before mfusion publishes the hook (the
# case of dvm), which is why the implementation is optional
PLUGINS = {"aregions": PLUGIN_SOURCE, "zbroken": BROKEN_SOURCE}


@pytest.fixture
def region_plugins(spore_plugin_source: Callable[[str, str], None]) -> None:
    """Two plugin distributions on ``sys.path``: ``aregions`` (an eager region compiler) and
    ``zbroken`` (its hook raises)."""
    for name, source in PLUGINS.items():
        spore_plugin_source(name, source)


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="mfusion.autofuse"):
        yield caplog


def _except(*keep: str) -> str:
    """``SPORE_DISABLE_PLUGINS`` for every installed plugin but ``keep`` (no allow-list: a
    plugin named in one counts as asked for, and fails hard)."""
    names = {ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return ",".join(sorted(names - set(keep)))


def plugin_compiler() -> EagerRegionCompiler:
    return sys.modules[f"{MODULE}aregions"].COMPILER


def region_ops(graph_counts: Any) -> int:
    return sum(v for k, v in graph_counts.items() if k.startswith(REGION))


def ops_of(region: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in region.graph.nodes if n.op == "call_function"]


def gated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.mm(x, w)
    return (h * torch.sigmoid(h) + 1) * 2 - x


def test_a_plugin_provides_region_compilers_through_the_hook(
    region_plugins: None, spore_manager: Callable[..., Any]
) -> None:
    manager = spore_manager({"SPORE_PLUGINS": "mfusion,aregions"})
    assert region_compilers() == [plugin_compiler()]
    statuses = {i.name: i.status.value for i in manager.plugins()}
    assert (statuses["aregions"], statuses["mfusion"]) == ("active", "active")
    assert region_compilers()[0] is plugin_compiler()  # collected once per manager


def test_a_plugin_whose_hook_raises_is_skipped_with_a_warning(
    region_plugins: None, spore_manager: Callable[..., Any], warnings: pytest.LogCaptureFixture
) -> None:
    spore_manager({"SPORE_DISABLE_PLUGINS": _except("mfusion", "aregions", "zbroken")})
    assert region_compilers() == [plugin_compiler()]
    (record,) = warnings.records
    assert record.getMessage() == (
        "spore plugin 'zbroken': hook mfusion_register_region_compilers raised: RuntimeError: "
        "cannot find the fused-kernel library; its region compilers are skipped"
    )


@pytest.mark.parametrize(
    "env",
    [{"SPORE_PLUGINS": "mfusion,zbroken"}, {"SPORE_STRICT_PLUGINS": "1"}],
    ids=["asked-for-by-name", "strict"],
)
def test_a_failing_hook_is_an_error_when_asked_for_or_strict(
    region_plugins: None, spore_manager: Callable[..., Any], env: dict[str, str]
) -> None:
    env = {"SPORE_DISABLE_PLUGINS": _except("mfusion", "zbroken"), **env}
    spore_manager(env)
    with pytest.raises(PluginError, match="'zbroken': hook mfusion_register_region_compilers"):
        region_compilers()


def test_compile_outlines_the_plugins_regions(
    region_plugins: None, only_autofuse: None, mfusion_compile: Callable[..., Any]
) -> None:
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    compiled = mfusion_compile(gated, x, w, env={"SPORE_PLUGINS": "mfusion,aregions"})
    (graph,) = compiled.graphs
    assert region_ops(graph) == 1
    assert graph["aten.mm.default"] == 1
    (region,) = plugin_compiler().compiled
    assert ops_of(region) == [
        "aten.sigmoid.default",
        "aten.mul.Tensor",
        "aten.add.Tensor",
        "aten.mul.Tensor",
        "aten.sub.Tensor",
    ]
    torch.testing.assert_close(compiled.outputs, gated(x, w))  # fp32: default tolerance


def test_compile_forward_and_backward_with_a_registered_compiler(
    only_autofuse: None, mfusion_compile: Callable[..., Any]
) -> None:
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    with register_region_compiler(EagerRegionCompiler("registered")) as compiler:
        compiled = mfusion_compile(gated, xc, wc, env={"SPORE_PLUGINS": "mfusion"})
        compiled.outputs.sum().backward()
    expected = gated(xe, we)
    expected.sum().backward()
    forward, backward = compiled.graphs
    # forward: the same region as in inference (mm is saved for the backward, not in it)
    assert region_ops(forward) == 1
    # backward: d/dh of h*sigmoid(h) with the ·2 folded in is one region; neg(tangents) alone
    # feeds the addmm Inductor forms, so it stays out
    assert region_ops(backward) == 1
    assert backward["aten.neg.default"] == 1
    assert [len(ops_of(r)) for r in compiler.compiled] == [5, 8]
    torch.testing.assert_close(compiled.outputs, expected)
    torch.testing.assert_close(xc.grad, xe.grad)
    torch.testing.assert_close(wc.grad, we.grad)


class Failing(EagerRegionCompiler):
    def compile(self, region_graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        raise RuntimeError("out of registers")


def test_a_failing_compiler_leaves_the_regions_to_inductor(
    only_autofuse: None, mfusion_compile: Callable[..., Any], warnings: pytest.LogCaptureFixture
) -> None:
    x, w = torch.randn(8, 16), torch.randn(16, 16)
    with register_region_compiler(Failing("failing")):
        compiled = mfusion_compile(gated, x, w, env={"SPORE_PLUGINS": "mfusion"})
    (graph,) = compiled.graphs
    assert region_ops(graph) == 0
    assert graph["aten.sigmoid.default"] == 1
    (record,) = warnings.records
    assert "region compiler 'failing' failed on a region of 5 nodes" in record.getMessage()
    assert "RuntimeError: out of registers; the region is left to Inductor" in record.getMessage()
    torch.testing.assert_close(compiled.outputs, gated(x, w))
