"""mfusion and dvm installed together: ``torch.compile(fn, backend="spore")`` hands the long
tail of pointwise ops that mfusion's automatic fusion finds to dvm's region compiler (through
the ``mfusion_register_region_compilers`` hook), forward and backward, equal to eager;
``MFUSION_DISABLE=autofuse`` (or dvm switched off) leaves the graph to Inductor. On CPU,
automatic fusion runs only when ``MFUSION_CPU`` names it (set here)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

REGION = "mfusion_regions."  # the namespace of mfusion's outlined region ops
RECORDER_PRIORITY = -(10**9)  # after every other post-grad pass, autofuse included


@pytest.fixture(autouse=True)
def inductor_cache(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Every test compiles into an Inductor cache folder of its own, from a reset dynamo."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    monkeypatch.delenv("MFUSION_DISABLE", raising=False)
    monkeypatch.setenv("MFUSION_CPU", "autofuse")  # on CPU it is off by default (mfusion README)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tail(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A matmul followed by a pointwise chain no hand-written mfusion pass rewrites."""
    h = torch.mm(x, w)
    return (torch.tanh(h) * torch.sigmoid(h) + 1) * 2 - x


def compile_recording(
    spore_manager: Callable[..., Any], plugins: str, *args: torch.Tensor
) -> tuple[torch.Tensor, list[collections.Counter[str]]]:
    """``torch.compile(tail, backend="spore")(*args)`` with only ``plugins`` loaded, and the op
    counts of each post-grad graph after every pass (forward, then backward once run)."""
    manager = spore_manager({"SPORE_PLUGINS": plugins})
    graphs: list[collections.Counter[str]] = []

    def record(gm: torch.fx.GraphModule) -> int:
        graphs.append(
            collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        )
        return 0

    manager.registry("passes").add(
        record, name="test.recorder", stage="post_grad", priority=RECORDER_PRIORITY
    )
    torch._dynamo.reset()
    return torch.compile(tail, backend="spore")(*args), graphs


def region_ops(counts: collections.Counter[str]) -> int:
    return sum(v for k, v in counts.items() if k.startswith(REGION))


def test_dvm_is_mfusions_region_compiler_when_both_are_installed(
    spore_manager: Callable[..., Any],
) -> None:
    from dvm.region_compiler import COMPILER
    from mfusion.autofuse import region_compilers

    spore_manager({"SPORE_PLUGINS": "mfusion,dvm"})
    assert COMPILER in region_compilers()


def test_the_pointwise_tail_runs_as_a_dvm_region_equal_to_eager(
    spore_manager: Callable[..., Any],
) -> None:
    from dvm.region_compiler import COMPILER

    x, w = torch.randn(24, 40), torch.randn(40, 40)
    before = COMPILER.compiled
    out, graphs = compile_recording(spore_manager, "mfusion,dvm", x, w)
    (forward,) = graphs
    assert region_ops(forward) == 1
    assert forward["aten.mm.default"] == 1
    assert forward["aten.tanh.default"] == forward["aten.sigmoid.default"] == 0
    assert COMPILER.compiled == before + 1
    torch.testing.assert_close(out, tail(x, w))


def test_forward_and_backward_regions_give_eager_gradients(
    spore_manager: Callable[..., Any],
) -> None:
    x, w = torch.randn(20, 36), torch.randn(36, 36)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    out, graphs = compile_recording(spore_manager, "mfusion,dvm", xc, wc)
    out.sum().backward()
    expected = tail(xe, we)
    expected.sum().backward()
    forward, backward = graphs
    assert region_ops(forward) >= 1
    assert region_ops(backward) >= 1
    assert backward["aten.tanh.default"] + backward["aten.sigmoid.default"] == 0
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(xc.grad, xe.grad)
    torch.testing.assert_close(wc.grad, we.grad)


def test_mfusion_disable_autofuse_leaves_the_graph_to_inductor(
    spore_manager: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dvm.region_compiler import COMPILER

    monkeypatch.setenv("MFUSION_DISABLE", "autofuse")
    x, w = torch.randn(28, 44), torch.randn(44, 44)
    before = COMPILER.compiled
    out, graphs = compile_recording(spore_manager, "mfusion,dvm", x, w)
    (forward,) = graphs
    assert region_ops(forward) == 0
    assert forward["aten.tanh.default"] == forward["aten.sigmoid.default"] == 1
    assert COMPILER.compiled == before
    torch.testing.assert_close(out, tail(x, w))


def test_without_the_dvm_plugin_autofuse_has_no_compiler(
    spore_manager: Callable[..., Any],
) -> None:
    x, w = torch.randn(12, 52), torch.randn(52, 52)
    out, graphs = compile_recording(spore_manager, "mfusion", x, w)
    (forward,) = graphs
    assert region_ops(forward) == 0
    assert forward["aten.tanh.default"] == 1
    torch.testing.assert_close(out, tail(x, w))
