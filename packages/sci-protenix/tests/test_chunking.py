"""The chunking helper and memory plans on modules: pieces join to the whole computation (exact:
the pieces are the same row operations), writes into ``out`` and accumulation, gradients through
the slice writes, chunk-size checks, and apply_plan reaching every sci-protenix module."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sci_protenix import PairformerStack, TriangleAttention, smooth_lddt_loss
from sci_protenix.chunking import (
    apply_plan,
    check_chunk_size,
    chunked,
    grad_free,
    inplace_requested,
    plan_chunk_size,
)
from sci_protenix.memory_plan import MemoryPlan
from spore.memory import peak


def _rows_fn(x: torch.Tensor, w: torch.Tensor):
    """A row-wise map of ``x`` [A, B, C] along axis ``dim`` = 1 (no reduction across it)."""
    return lambda sl: torch.tanh(x[:, sl] @ w)


@pytest.mark.parametrize("size", [None, 1, 3, 7, 50])
def test_chunked_equals_whole(size: int | None) -> None:
    x, w = torch.randn(2, 7, 5), torch.randn(5, 4)
    expected = torch.tanh(x @ w)
    calls = []
    fn = _rows_fn(x, w)

    def counted(sl: slice) -> torch.Tensor:
        calls.append(sl)
        return fn(sl)

    got = chunked(counted, 7, size, dim=1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    step = 7 if size is None else min(size, 7)
    assert [(s.start, s.stop) for s in calls] == [(i, min(i + step, 7)) for i in range(0, 7, step)]


def test_chunked_writes_and_accumulates_into_out() -> None:
    x, w = torch.randn(2, 6, 5), torch.randn(5, 5)
    base = torch.randn(2, 6, 5)
    out = base.clone()
    got = chunked(_rows_fn(x, w), 6, 4, dim=-2, out=out, accumulate=True)
    assert got is out
    torch.testing.assert_close(out, base + torch.tanh(x @ w), rtol=0, atol=1e-6)
    out = torch.zeros(2, 6, 5)
    chunked(_rows_fn(x, w), 6, 2, dim=1, out=out)
    torch.testing.assert_close(out, torch.tanh(x @ w), rtol=0, atol=1e-6)


def test_chunked_gradients_equal_plain_autograd() -> None:
    x, w = torch.randn(3, 9, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    (torch.tanh(x @ w) ** 2).sum().backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad, w.grad = None, None
    (chunked(_rows_fn(x, w), 9, 2, dim=1) ** 2).sum().backward()
    torch.testing.assert_close((x.grad, w.grad), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "bad", [0, -2, 1.5, True, "4", np.True_, torch.tensor(True), torch.tensor([4])]
)
def test_bad_chunk_sizes_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        check_chunk_size(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunked(lambda sl: torch.zeros(1), 4, bad, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [np.int64(4), np.int32(4), np.uint8(4)])
def test_numpy_integer_chunk_sizes_are_taken(size: object) -> None:
    """A chunk size computed with numpy (or read from a numpy config) is an integer as Python's
    is: taken as that int, not refused as if it were a float or a string."""
    assert check_chunk_size(size) == 4  # type: ignore[arg-type]
    assert type(check_chunk_size(size)) is int  # type: ignore[arg-type]
    x, w = torch.randn(3, 9, 4), torch.randn(4, 6)
    out = chunked(_rows_fn(x, w), 9, size, dim=1)  # type: ignore[arg-type]
    torch.testing.assert_close(out, torch.tanh(x @ w), rtol=0, atol=1e-6)
    attention = TriangleAttention(c_in=8, c_hidden=4, no_heads=2).eval()
    z = torch.randn(7, 7, 8)
    with torch.no_grad():
        torch.testing.assert_close(attention(z, chunk_size=size), attention(z))
    pred, true = torch.randn(2, 9, 3) * 5, torch.randn(9, 3) * 5
    torch.testing.assert_close(
        smooth_lddt_loss(pred, true, chunk_size=size), smooth_lddt_loss(pred, true)
    )


def test_empty_axis_is_one_call_over_the_empty_slice() -> None:
    calls: list[slice] = []

    def fn(sl: slice, x: torch.Tensor) -> torch.Tensor:
        calls.append(sl)
        return x[sl] * 2.0

    x = torch.randn(0, 3)
    for size in (None, 2):
        for split in (None, 0):
            calls.clear()
            got = chunked(fn, 0, size, 0, args=(x,), split=split)
            assert calls == [slice(0, 0)]
            assert got.shape == (0, 3)
    out = torch.ones(2, 0)
    assert chunked(fn, 0, 2, 1, args=(x,), out=out, accumulate=True) is out
    assert calls == [slice(0, 0)]  # nothing more to write into ``out``


def test_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="negative length"):
        chunked(lambda sl: torch.zeros(0), -1, 2, 0)


def test_plan_chunk_size_prefers_the_plan() -> None:
    module = nn.Linear(2, 2)
    assert plan_chunk_size(module, "tri_att", 8) == 8
    module.plan = MemoryPlan(tri_att=3)
    assert plan_chunk_size(module, "tri_att", 8) == 3
    assert plan_chunk_size(module, "tri_mul", 8) is None  # the plan says: run it whole
    # the MSA module's fields, which the planner leaves None, keep the module's own size
    assert plan_chunk_size(module, "msa", 8) == 8
    assert plan_chunk_size(module, "outer_product", 8) == 8
    module.plan = MemoryPlan(msa=2)
    assert plan_chunk_size(module, "msa", 8) == 2


def test_inplace_needs_a_request_and_no_gradient() -> None:
    module = nn.Linear(2, 2)
    x = torch.randn(2)
    assert not inplace_requested(module, False)
    assert inplace_requested(module, True)
    module.plan = MemoryPlan(inplace=True)
    assert inplace_requested(module, False)
    assert not grad_free(module, x)  # parameters require grad, grad mode on
    with torch.no_grad():
        assert grad_free(module, x)
    module.requires_grad_(False)
    assert grad_free(module, x)
    assert not grad_free(module, x.requires_grad_())


def test_apply_plan_reaches_every_sci_protenix_module() -> None:
    model = nn.Sequential(nn.Linear(2, 2), PairformerStack(n_blocks=2, n_heads=2, c_z=4, c_s=4))
    plan = MemoryPlan(tri_mul=2, recompute="block")
    assert apply_plan(model, plan) is model
    ours = [m for m in model.modules() if type(m).__module__.startswith("sci_protenix.")]
    assert len(ours) > 10
    assert all(m.plan is plan for m in ours)
    assert "plan" not in vars(model[0])
    assert "plan" not in vars(model)
    apply_plan(model, None)
    assert all(m.plan is None for m in ours)


def test_apply_plan_reaches_subclasses_of_sci_protenix_modules() -> None:
    class MyStack(PairformerStack):
        pass

    stack = MyStack(n_blocks=2, n_heads=2, c_z=4, c_s=4)
    plan = MemoryPlan(recompute="block")
    apply_plan(nn.Sequential(stack), plan)
    assert stack.plan is plan  # its stack-level recompute would be dropped otherwise
    assert all(block.plan is plan for block in stack.blocks)


def test_apply_plan_refuses_non_plans() -> None:
    with pytest.raises(TypeError, match="MemoryPlan"):
        apply_plan(nn.Linear(2, 2), {"tri_mul": 4})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"nn\.Module"):
        apply_plan(object(), MemoryPlan())  # type: ignore[type-var]


@pytest.mark.parametrize("plan", [MemoryPlan(tri_mul=4), None])
def test_apply_plan_refuses_a_module_without_sci_protenix_modules(plan) -> None:
    """A plan applied to the wrong module is an error naming what apply_plan looks for, as
    boost's is for a model without Protenix modules (it returned the module unchanged)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    with pytest.raises(ValueError, match=r"no sci-protenix module in Sequential") as error:
        apply_plan(model, plan)
    for name in ("PairformerStack", "MSAModule", "TriangleAttention", "OuterProductMean"):
        assert name in str(error.value)
    assert "sci_protenix.boost(model, plan)" in str(error.value)
    assert all("plan" not in vars(m) for m in model.modules())


def test_pieces_without_gradient_are_written_into_one_tensor() -> None:
    """No piece kept beside the output when nothing needs a gradient (grad mode on or off):
    the peak stays under the output plus two pieces (concatenating would hold twice it)."""
    x = torch.randn(16, 4096)
    out_bytes = x.numel() * 4
    for grad in (True, False):
        with torch.set_grad_enabled(grad), peak() as measured:
            got = chunked(lambda sl: x[sl] * 2.0, 16, 2, dim=0)
        torch.testing.assert_close(got, x * 2.0, rtol=0, atol=0)
        assert measured.peak_bytes <= out_bytes * (1 + 2 / 8)
