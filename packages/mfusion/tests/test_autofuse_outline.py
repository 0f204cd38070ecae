"""Outlining regions into custom ops on ``make_fx`` graphs, run on real inputs: equality with the
original graph, idempotence, the compile cache, failure isolation, the output contract, the
Python registration API and the pass with no compiler."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion.autofuse import fuse, region_compilers, register_region_compiler
from mfusion.autofuse.eager import POINTWISE, EagerRegionCompiler
from mfusion.passes.autofuse import AutoFuse

REGION = "mfusion_regions."


def trace(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, tracing_mode="fake")(*args)


def targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def region_calls(gm: torch.fx.GraphModule) -> list[str]:
    return [t for t in targets(gm) if t.startswith(REGION)]


def branches(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = x * 2 + 1
    s = torch.mm(a, y)  # a leaves the region here
    return s, a.exp() - 1


def crossing(p: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = p.exp()
    b = q.exp()
    x = a.cos()
    y = b.cos()
    return b * x, a * y  # {a, a*y} needs y (from b), {b, b*x} needs x (from a)


@pytest.fixture
def warnings(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="mfusion.autofuse"):
        yield caplog


@pytest.fixture
def no_plugins(spore_manager: Any) -> Any:
    """A plugin manager with mfusion only: no plugin provides a region compiler."""
    return spore_manager({"SPORE_PLUGINS": "mfusion"})


def test_outlined_graph_equals_the_original() -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    gm = trace(branches, x, y)
    compiler = EagerRegionCompiler()
    assert fuse(gm, [compiler]) == 1
    (call,) = region_calls(gm)
    getitem = "<built-in function getitem>"
    assert targets(gm) == [call, getitem, getitem, "aten.mm.default"]
    (region,) = compiler.compiled
    assert [str(n.target) for n in region.graph.nodes if n.op == "call_function"] == [
        "aten.mul.Tensor",
        "aten.add.Tensor",
        "aten.exp.default",
        "aten.sub.Tensor",
    ]
    for _ in range(3):
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        torch.testing.assert_close(gm(x, y), branches(x, y), rtol=0, atol=0)


@pytest.mark.parametrize("how", ["call_method", "operator.iadd"])
def test_no_region_spans_a_mutation_torch_calls_pure(how: str) -> None:
    """A hand-built graph mutating ``buf`` between ops that read it, by a method or a plain
    callable (both pure to ``Node.is_impure``): the ops before and after make a region each,
    and each reads ``buf`` as the original graph does (one region spanning the mutation ran
    after it and read the mutated value twice)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    before = g.call_function(aten.sigmoid.default, (g.call_function(aten.mul.Tensor, (x, buf)),))
    if how == "call_method":
        g.call_method("add_", (buf, 1.0))
    else:
        g.call_function(operator.iadd, (buf, 1.0))
    after = g.call_function(aten.exp.default, (g.call_function(aten.add.Tensor, (before, buf)),))
    g.output((after,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    x, buf = torch.randn(4, 6), torch.randn(4, 6)
    want = gm(x, buf.clone())
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x, buf.clone())
    assert fuse(gm, [EagerRegionCompiler()]) == 2
    gm.recompile()
    torch.testing.assert_close(gm(x, buf.clone()), want, rtol=0, atol=0)


def test_regions_that_cross_through_outside_nodes_are_placed_one_by_one() -> None:
    p, q = torch.randn(5), torch.randn(5)
    gm = trace(crossing, p, q)
    compiler = EagerRegionCompiler()
    # both pairs merge (each is convex), but {exp, mul_1} has no place: its op would have to
    # follow cos_1 (mul_1 reads it) and precede cos (which reads exp); {exp_1, mul} has one
    assert fuse(gm, [compiler]) == 1
    (region,) = compiler.compiled
    assert [str(n.target) for n in region.graph.nodes if n.op == "call_function"] == [
        "aten.exp.default",
        "aten.mul.Tensor",
    ]
    gm.graph.lint()
    torch.testing.assert_close(gm(p, q), crossing(p, q), rtol=0, atol=0)


def test_no_region_moves_a_read_across_a_mutation() -> None:
    def mutating(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = x * 2  # reads x before the mutation; the op of {mul, add} would go after cos
        x.add_(1)
        return a + y.cos(), x

    def pure(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y.cos()

    x, y = torch.randn(5), torch.randn(5)
    gm = trace(mutating, x.clone(), y)
    assert fuse(gm, [EagerRegionCompiler()]) == 0
    torch.testing.assert_close(gm(x.clone(), y), mutating(x.clone(), y), rtol=0, atol=0)
    control = trace(pure, x, y)
    assert fuse(control, [EagerRegionCompiler()]) == 1
    torch.testing.assert_close(control(x, y), pure(x, y), rtol=0, atol=0)


def test_a_second_run_rewrites_nothing() -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    gm = trace(branches, x, y)
    compiler = EagerRegionCompiler()
    assert fuse(gm, [compiler]) == 1
    code = gm.code
    assert fuse(gm, [compiler]) == 0
    assert gm.code == code
    assert len(compiler.compiled) == 1


def test_a_region_nothing_reads_is_left_alone(warnings: pytest.LogCaptureFixture) -> None:
    """A dead chain (a pass before may leave one) formed a region with no outputs: outlining
    it inserted the call, then failed on its outputs, leaving the graph half rewritten."""

    def dead(x: torch.Tensor) -> torch.Tensor:
        (x + 1) * 2
        return torch.cos(x)

    gm = trace(dead, torch.randn(4, 4))
    compiler = EagerRegionCompiler()
    code = gm.code
    assert fuse(gm, [compiler]) == 0
    assert gm.code == code
    assert compiler.compiled == []
    assert not warnings.records


def test_identical_regions_share_one_compile_and_one_op() -> None:
    def twice(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x * 2 + 1).relu(), (y * 2 + 1).relu()

    x, y = torch.randn(3, 5), torch.randn(3, 5)
    gm = trace(twice, x, y)
    compiler = EagerRegionCompiler()
    assert fuse(gm, [compiler]) == 2
    calls = region_calls(gm)
    assert len(calls) == 2
    assert calls[0] == calls[1]
    assert len(compiler.compiled) == 1
    other = trace(twice, torch.randn(3, 6), torch.randn(3, 6))  # other shapes: another op
    assert fuse(other, [compiler]) == 2
    assert region_calls(other)[0] != calls[0]
    assert len(compiler.compiled) == 2
    torch.testing.assert_close(gm(x, y), twice(x, y), rtol=0, atol=0)


def test_each_compiler_gets_the_nodes_left() -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    gm = trace(branches, x, y)
    first = EagerRegionCompiler("muls", ops=[torch.ops.aten.mul, torch.ops.aten.add])
    second = EagerRegionCompiler("rest")
    assert fuse(gm, [first, second]) == 2
    assert len(first.compiled) == 1
    assert len(second.compiled) == 1
    assert [str(n.target) for n in second.compiled[0].graph.nodes if n.op == "call_function"] == [
        "aten.exp.default",
        "aten.sub.Tensor",
    ]
    torch.testing.assert_close(gm(x, y), branches(x, y), rtol=0, atol=0)


class Failing(EagerRegionCompiler):
    def __init__(self) -> None:
        super().__init__("failing")
        self.calls = 0

    def compile(
        self, region_graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
    ) -> Any:
        self.calls += 1
        raise RuntimeError("no kernel for this region")


def test_a_compile_that_raises_leaves_the_region_with_a_warning(
    warnings: pytest.LogCaptureFixture,
) -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    gm = trace(branches, x, y)
    code = gm.code
    compiler = Failing()
    assert fuse(gm, [compiler]) == 0
    assert gm.code == code
    (record,) = warnings.records
    assert "region compiler 'failing' failed on a region of 4 nodes" in record.getMessage()
    assert "RuntimeError: no kernel for this region" in record.getMessage()
    assert fuse(gm, [compiler]) == 0
    assert compiler.calls == 1  # the failure is cached: no second attempt, no second warning
    assert len(warnings.records) == 1


def test_a_compile_with_wrong_values_is_rejected(warnings: pytest.LogCaptureFixture) -> None:
    class OffByOne(EagerRegionCompiler):
        def compile(self, region_graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            return lambda *inputs: tuple(t + 1 for t in region_graph(*inputs))

    gm = trace(branches, torch.randn(4, 4), torch.randn(4, 4))
    assert fuse(gm, [OffByOne("off-by-one")]) == 0
    assert region_calls(gm) == []
    (record,) = warnings.records
    assert "AssertionError: output 0: Tensor-likes are not close" in record.getMessage()


def _bf16_chain(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
    h = a + b  # eager rounds this bf16 step
    return h * c - a, h.float().pow(2).mean(-1)  # cancels where h * c ~ a; an fp32 output


class Float32Inside(EagerRegionCompiler):
    """Computes a region in float32 between its loads and stores, as the contract allows (and
    Inductor and dvm do), rounding only the outputs; ``shift`` adds that to each output."""

    def __init__(self, name: str, shift: float = 0.0) -> None:
        aten = torch.ops.aten
        super().__init__(name, ops=(*POINTWISE, aten._to_copy, aten.pow, aten.mean))
        self.shift = shift

    def compile(self, region_graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.compiled.append(region_graph)
        dtypes = [o.dtype for o in region_graph(*example_inputs)]

        def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            outs = region_graph(*[t.float() for t in inputs])
            return tuple((o + self.shift).to(d) for o, d in zip(outs, dtypes, strict=True))

        return run


def test_a_region_computing_its_16_bit_steps_in_float32_is_accepted(
    warnings: pytest.LogCaptureFixture,
) -> None:
    """It differs from eager's per-step rounding by about an ulp of bf16, more where a sum
    cancels, and in an fp32 output computed from a bf16 step: it was rejected at the default
    tolerances (bf16 regions of dvm in Gemma and Qwen3 training were left to Inductor with a
    warning each). A compile off by a few bf16 ulps of the outputs' scale is still rejected."""
    args = [torch.randn(64, 96, dtype=torch.bfloat16) for _ in range(3)]
    gm = trace(_bf16_chain, *args)
    compiler = Float32Inside("float32-inside")
    assert fuse(gm, [compiler]) == 1
    assert warnings.records == []
    assert len(compiler.compiled) == 1
    gm = trace(_bf16_chain, *args)
    assert fuse(gm, [Float32Inside("shifted", shift=0.25)]) == 0
    assert "Tensor-likes are not close" in warnings.records[0].getMessage()


def test_a_compile_with_the_wrong_output_count_is_rejected(
    warnings: pytest.LogCaptureFixture,
) -> None:
    class FirstOnly(EagerRegionCompiler):
        def compile(self, region_graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            return lambda *inputs: region_graph(*inputs)[0]

    gm = trace(branches, torch.randn(4, 4), torch.randn(4, 4))
    assert fuse(gm, [FirstOnly("first-only")]) == 0
    assert "the callable returned 1 outputs, the region has 2" in warnings.records[0].getMessage()


def test_a_supports_that_raises_counts_as_unsupported(warnings: pytest.LogCaptureFixture) -> None:
    class Picky(EagerRegionCompiler):
        def supports(self, node: torch.fx.Node) -> bool:
            if node.target is torch.ops.aten.exp.default:
                raise KeyError("exp")
            return super().supports(node)

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    gm = trace(branches, x, y)
    compiler = Picky("picky")
    assert fuse(gm, [compiler]) == 1
    assert [str(n.target) for n in compiler.compiled[0].graph.nodes if n.op == "call_function"] == [
        "aten.mul.Tensor",
        "aten.add.Tensor",
    ]
    (record,) = warnings.records
    assert "supports(aten.exp.default) raised KeyError" in record.getMessage()
    torch.testing.assert_close(gm(x, y), branches(x, y), rtol=0, atol=0)


@pytest.mark.parametrize(
    "returned",
    [lambda x: x, lambda x: x.t().contiguous().t()],
    ids=["aliases-the-input", "other-strides"],
)
def test_the_op_returns_fresh_tensors_with_the_promised_strides(returned: Callable) -> None:
    class Identity(EagerRegionCompiler):
        def compile(self, region_graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
            return returned

    gm = trace(lambda x: x * 1 + 0, torch.randn(4, 6))
    assert fuse(gm, [Identity("identity")]) == 1
    (call,) = (n for n in gm.graph.nodes if str(n.target).startswith(REGION))
    x = torch.randn(4, 6)
    out = call.target(x)
    assert out.stride() == (6, 1)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_without_a_compiler_the_pass_changes_nothing(no_plugins: Any) -> None:
    from spore import passes

    gm = trace(branches, torch.randn(4, 4), torch.randn(4, 4))
    code = gm.code
    assert region_compilers() == []
    assert fuse(gm, []) == 0
    assert AutoFuse()(gm) == 0
    assert passes.apply(gm)["mfusion.autofuse"] == 0
    assert gm.code == code
    assert AutoFuse().version == "1"


def test_the_pass_version_names_the_compilers(no_plugins: Any) -> None:
    """The version says what the compilers are (class, name, version), not which objects in
    what order: it held a serial counted per process, so the same setup had another FX graph
    cache key in a process that registered the compilers in another order or again."""

    class Other(EagerRegionCompiler):
        pass

    def version(*compilers: EagerRegionCompiler) -> str:
        registrations = [register_region_compiler(c) for c in compilers]
        try:
            return AutoFuse().version
        finally:
            for registration in registrations:
                registration.remove()

    first = version(EagerRegionCompiler("a"))
    assert first.startswith("1+")
    assert version(EagerRegionCompiler("a")) == first  # another object
    others = [
        version(EagerRegionCompiler("a", version="2")),
        version(EagerRegionCompiler("b")),
        version(Other("a")),
        version(EagerRegionCompiler("a"), EagerRegionCompiler("b")),
    ]
    assert len({"1", first, *others}) == 6
    assert version(EagerRegionCompiler("b"), EagerRegionCompiler("a")) == others[-1]
    assert AutoFuse().version == "1"


def test_an_active_compiler_keeps_graphs_the_pass_can_change_from_the_cache(
    no_plugins: Any, monkeypatch: Any
) -> None:
    """A compiled region lives in its process: where the pass can run, its uuid() is None
    (Inductor bypasses its FX graph cache); where it cannot, the key is the version."""
    from mfusion import selection

    monkeypatch.delenv(selection.ENV, raising=False)
    monkeypatch.delenv(selection.CPU_ENV, raising=False)
    switched = selection.Switched(AutoFuse())  # as the plugin registers it
    assert AutoFuse().uuid() == "1"
    assert switched.uuid() == switched.version
    with register_region_compiler(EagerRegionCompiler("a")):
        assert AutoFuse().uuid() is None
        if not torch.accelerator.is_available():  # CPU graphs only: left alone unless forced
            assert switched.uuid() == switched.version
        selection.enable_passes("autofuse")
        assert switched.uuid() is None
        selection.disable_passes("autofuse")
        assert switched.version.endswith("+off")
        assert switched.uuid() == switched.version
    selection.reset()


def test_the_pass_outlines_with_a_registered_compiler(no_plugins: Any) -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    gm = trace(branches, x, y)
    with register_region_compiler(EagerRegionCompiler("registered")) as compiler:
        assert region_compilers() == [compiler]
        assert AutoFuse()(gm) == 1
    assert region_compilers() == []
    torch.testing.assert_close(gm(x, y), branches(x, y), rtol=0, atol=0)


def test_registration_checks_the_protocol() -> None:
    class NoCompile:
        name = "half"

        def supports(self, node: torch.fx.Node) -> bool:
            return True

    with pytest.raises(TypeError, match=r"'half' \(NoCompile\) lacks the method\(s\) compile"):
        register_region_compiler(NoCompile())  # type: ignore[arg-type]
    nameless = EagerRegionCompiler("")
    with pytest.raises(TypeError, match="non-empty string attribute 'name'"):
        register_region_compiler(nameless)
    registration = register_region_compiler(EagerRegionCompiler("taken"))
    try:
        with pytest.raises(ValueError, match="'taken' is already registered"):
            register_region_compiler(EagerRegionCompiler("taken"))
    finally:
        registration.remove()
    registration.remove()  # a second remove does nothing
    register_region_compiler(EagerRegionCompiler("taken")).remove()
