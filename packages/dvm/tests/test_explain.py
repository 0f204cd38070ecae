"""dvm.explain: regions with their ops, programs and domains; fallbacks with reasons; forward
and backward graphs; the user's gradients untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dvm
from dvm.backend import make_backend
from dvm.cluster import NO_WORK


def test_forward_regions_and_fallbacks():
    def fn(x, w):
        y = torch.softmax(x * w, -1)
        return y.sum(0), F.silu(x)

    x, w = torch.randn(4, 8), torch.randn(8)
    e = dvm.explain(fn, x, w)
    assert list(e.graphs) == ["inference"]
    assert e.executor == "vm"
    assert len(e.regions) == 1
    (region,) = e.regions
    assert region.domain == (4, 8)
    assert "aten._softmax.default" in region.ops  # whole: its decomposition in the program
    assert "aten.silu.default" in region.ops  # whole too: x * sigmoid(x) in the program
    assert "sigmoid" in region.program
    assert "reduce_max" in region.program
    assert "reduce_sum" in region.program
    assert region.compile_us > 0
    (fb,) = e.fallbacks
    assert fb.op == "aten.sum.dim_IntList"
    assert "dim 0" in fb.reason
    text = str(e)
    assert "region 0 [inference] domain (4, 8)" in text
    assert "reduce_max" in text
    assert "left to eager" in text
    assert fb.reason in text


def test_a_reduction_over_rows_too_long_for_the_vm_is_a_fallback():
    from dvm.program import MAX_ROW

    e = dvm.explain(lambda x: torch.softmax(F.silu(x) * 2, -1), torch.randn(2, MAX_ROW + 1))
    (region,) = e.regions
    assert region.ops == ["aten.silu.default", "aten.mul.Tensor"]
    (fb,) = e.fallbacks
    assert fb.op == "aten._softmax.default"
    assert f"rows of {MAX_ROW + 1} elements" in fb.reason
    assert fb.reason in str(e)


def test_a_region_that_ran_eagerly_says_why():
    """A lazily negated input passes dynamo's guards and the region's compile, and the region's
    guard runs its aten ops eagerly: explain used to show it as run on the VM."""
    z = torch.randn(4, 8, dtype=torch.complex64)
    e = dvm.explain(lambda x: torch.sigmoid(x * 2) + 1, z.conj().imag)
    (region,) = e.regions
    assert region.vm_calls == 0
    ((why, calls),) = region.eager_calls.items()
    assert calls == 1
    assert "lazily negated" in why
    assert f"ran eagerly in 1 of 1 call(s): {why}" in str(e)
    plain = dvm.explain(lambda x: torch.sigmoid(x * 2) + 1, torch.randn(4, 8))
    (region,) = plain.regions
    assert region.vm_calls == 1
    assert region.eager_calls == {}
    assert "ran eagerly" not in str(plain)


def test_keyword_arguments_reach_the_function():
    def fn(x, *, scale, fn=None):  # a keyword named like explain's own argument too
        return F.silu(x) * scale + x

    x, scale = torch.randn(4, 8), torch.randn(8)
    e = dvm.explain(fn, x, scale=scale, fn=None)
    (region,) = e.regions
    assert region.inputs == ["arg0_1", "arg1_1"]  # scale is a graph input, not a constant
    assert "aten.silu.default" in region.ops


def test_a_random_op_is_explained_and_splits_the_regions():
    """Dropout draws random numbers: it stays eager with that reason, and the ops on each
    side of it make regions of their own."""

    def fn(x):
        y = F.dropout(torch.sigmoid(x) * x, 0.5, training=True)
        return torch.exp(y) * y

    e = dvm.explain(fn, torch.randn(8, 16))
    (dropout,) = [f for f in e.fallbacks if f.op == "aten.native_dropout.default"]
    assert "draws random numbers" in dropout.reason
    assert dropout.reason in str(e)
    assert [r.ops for r in e.regions] == [
        ["aten.sigmoid.default", "aten.mul.Tensor"],
        ["aten.exp.default", "aten.mul.Tensor"],
    ]


def test_backward_is_explained_and_grads_untouched():
    w = torch.randn(6, requires_grad=True)
    x = torch.randn(3, 6, requires_grad=True)
    e = dvm.explain(lambda a: F.gelu(a * w, approximate="tanh").double(), x)
    assert list(e.graphs) == ["forward", "backward"]
    kinds = {r.graph for r in e.regions}
    assert kinds == {"forward", "backward"}
    assert any("float64" in f.reason for f in e.fallbacks)
    assert x.grad is None
    assert w.grad is None


class _ScaleTanh(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 10))
        self.bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.weight + self.bias)


def test_module_parameters_get_a_backward():
    block = _ScaleTanh()
    e = dvm.explain(block, torch.randn(2, 10))
    assert "backward" in e.graphs
    assert all(p.grad is None for p in block.parameters())
    assert any(r.graph == "backward" for r in e.regions)
    # the input needs no grad: the backward is the weight and bias grads, summed over dim 0
    backward = [f for f in e.fallbacks if f.graph == "backward"]
    sums = [f for f in backward if f.op == "aten.sum.dim_IntList"]
    assert len(sums) == 2
    assert all("dim 0" in f.reason for f in sums)
    # the rest are the views of the sums to the parameters' shapes: no kernel to fuse
    assert {(f.op, f.reason) for f in backward if f not in sums} == {("aten.view.default", NO_WORK)}


def test_a_closure_over_a_model_gets_a_backward():
    """The backward's leaves come from the result's autograd graph: a closure's parameters
    (it was skipped when ``fn`` was neither a module nor given inputs that need grad)."""
    block = _ScaleTanh()
    e = dvm.explain(lambda t: block(t) * 2, torch.randn(2, 10))
    assert list(e.graphs) == ["forward", "backward"]
    assert all(p.grad is None for p in block.parameters())


def test_explaining_again_and_again_leaves_the_users_compile_alone():
    """Each explain compiles a code object of its own: ``fn``'s own stays free of them (9 calls
    used to pass dynamo's recompile limit of 8, and later explains found nothing, nor did the
    user's own compile of ``fn``)."""

    def gate(x, y):
        return F.silu(x) * y

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    limit = torch._dynamo.config.recompile_limit
    for _ in range(limit + 2):
        assert len(dvm.explain(gate, x, y).regions) == 1
    compiled = []
    backend = make_backend(lambda kind, graph: compiled.append(graph))
    torch.testing.assert_close(torch.compile(gate, backend=backend)(x, y), gate(x, y))
    assert len(compiled) == 1


def test_options_are_the_backends():
    """``options={"min_ops": 1}`` explains what that compile runs: a lone op's region on the
    VM, where the default options leave it to eager as a single op."""

    def fn(x, *, scale):
        return torch.exp(x) @ scale

    x, scale = torch.randn(4, 8), torch.randn(8, 3)
    default = dvm.explain(fn, x, scale=scale)
    assert default.regions == []
    reasons = {f.op: f.reason for f in default.fallbacks}
    assert reasons.keys() == {"aten.exp.default", "aten.mm.default"}
    assert reasons["aten.exp.default"].startswith("a single op")
    one = dvm.explain(fn, x, scale=scale, options={"min_ops": 1})
    (region,) = one.regions
    assert region.ops == ["aten.exp.default"]
    assert region.vm_calls == 1
    assert [f.op for f in one.fallbacks] == ["aten.mm.default"]


@pytest.mark.parametrize(
    "options", [{"min_op": 1}, {"min_ops": 0}, {"size_limit": 2.5}, {1: 2}, {"options": {}}]
)
def test_bad_options_are_the_backends_error(options):
    """A bad ``options`` is the backend's ``ValueError``, raised before ``fn`` runs."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: torch.exp(t) * 2, backend="dvm", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as backend:
        compiled(torch.randn(3))
    ran = []
    with pytest.raises(ValueError, match=r"^dvm: bad torch\.compile options") as info:
        dvm.explain(lambda t: ran.append(t), torch.randn(3), options=options)
    assert str(info.value) in str(backend.value)
    assert ran == []


def test_fallbacks_name_python_functions_by_module():
    """A getitem of a multi-output op reads ``getitem (operator.getitem)`` as an aten op's
    fallback reads ``max_1 (aten.max.dim)``: it was ``<built-in function getitem>``."""
    e = dvm.explain(lambda x: x.max(-1), torch.randn(4, 8))
    ops = {f.node: f.op for f in e.fallbacks}
    assert ops == {
        "max_1": "aten.max.dim",
        "getitem": "operator.getitem",
        "getitem_1": "operator.getitem",
    }
    assert "[inference] getitem (operator.getitem): getitem of a multi-output op" in str(e)
    assert "built-in" not in str(e)
