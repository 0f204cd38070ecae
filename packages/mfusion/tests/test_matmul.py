"""mfusion's matmul passes on aten graphs traced with make_fx and on real mfusion compiles.

Graphs are traced with Inductor's decomposition table, so they hold the post-grad ops
(``permute``, ``convert_element_type``, ``view``) the passes see inside a compile.

Tolerance (largest absolute difference over the largest absolute eager value): float32 1e-5
(a rewritten GEMM may sum in another order, or add the bias inside the accumulation);
bfloat16 2e-2 and float16 2e-3 (``addmm`` rounds once where eager ``mm + add`` rounds twice, and
GEMM kernels of another layout sum in another order: a few ulps, 2**-8 and 2**-11 each).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from mfusion.passes import all_passes, matmul

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
MM, ADDMM, BMM = "aten.mm.default", "aten.addmm.default", "aten.bmm.default"
ADD, MUL, CLONE = "aten.add.Tensor", "aten.mul.Tensor", "aten.clone.default"
CONVERT = "prims.convert_element_type.default"
Rewritten = tuple[int, collections.Counter[str], collections.Counter[str]]


def _randn(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ops(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    return collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _trace(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    """``fn`` as Inductor's post-grad passes get it: decomposed, dead code removed."""
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


@pytest.fixture
def rewrite(assert_rel_close: Callable[..., None]) -> Callable[..., Rewritten]:
    """``rewrite(pass_, fn, *args)``: trace ``fn``, run ``pass_`` on it and check it against
    eager; a second run must change nothing. Returns (rewrites, op counts before, after)."""

    def run(pass_: Any, fn: Callable[..., Any], *args: torch.Tensor) -> Rewritten:
        gm = _trace(fn, *args)
        before = _ops(gm)
        count = pass_(gm)
        gm.graph.lint()
        gm.recompile()
        after = _ops(gm)
        got, want = gm(*args), fn(*args)
        for g, w in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want)), strict=True):
            assert_rel_close(g, w)
        assert pass_(gm) == 0, "a second run rewrote again"
        assert _ops(gm) == after
        return count, before, after

    return run


@pytest.fixture
def unchanged(rewrite: Callable[..., Rewritten]) -> Callable[..., None]:
    """``unchanged(pass_, fn, *args)``: ``rewrite`` that must find nothing to rewrite."""

    def run(pass_: Any, fn: Callable[..., Any], *args: torch.Tensor) -> None:
        count, before, after = rewrite(pass_, fn, *args)
        assert (count, after) == (0, before)

    return run


# --- matmul-reshape-bias -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshaped_mm_plus_bias_becomes_addmm(rewrite, dtype: torch.dtype) -> None:
    x, w, b = _randn(dtype, 2, 5, 16), _randn(dtype, 8, 16, seed=1), _randn(dtype, 8, seed=2)
    count, before, after = rewrite(matmul.MmReshapeBias(), lambda x, w, b: x @ w.t() + b, x, w, b)
    assert count == 1
    assert (before[MM], before[ADD], before[ADDMM]) == (1, 1, 0)
    assert (after[MM], after[ADD], after[ADDMM]) == (0, 0, 1)
    assert after["aten.view.default"] == before["aten.view.default"] == 2


def test_bias_on_either_side_and_4d_input(rewrite) -> None:
    x, w, b = (
        _randn(torch.float32, 2, 3, 4, 16),
        _randn(torch.float32, 16, 8),
        _randn(torch.float32, 8),
    )
    count, _, after = rewrite(matmul.MmReshapeBias(), lambda x, w, b: b + x @ w, x, w, b)
    assert (count, after[ADDMM], after[ADD]) == (1, 1, 0)


@pytest.mark.parametrize(
    "bias_shape", [pytest.param((5, 8), id="2-D bias"), pytest.param((1,), id="scalar-like bias")]
)
def test_bias_that_is_not_one_per_column_is_left_alone(
    unchanged, bias_shape: tuple[int, ...]
) -> None:
    x, w = _randn(torch.float32, 2, 5, 16), _randn(torch.float32, 16, 8)
    unchanged(
        matmul.MmReshapeBias(), lambda x, w, b: x @ w + b, x, w, _randn(torch.float32, *bias_shape)
    )


def test_bias_of_another_dtype_is_left_alone(unchanged) -> None:
    x, w = _randn(torch.bfloat16, 2, 5, 16), _randn(torch.bfloat16, 16, 8)
    unchanged(matmul.MmReshapeBias(), lambda x, w, b: x @ w + b, x, w, _randn(torch.float32, 8))


def test_view_that_moves_the_columns_is_left_alone(unchanged) -> None:
    x, w, b = _randn(torch.float32, 4, 16), _randn(torch.float32, 16, 8), _randn(torch.float32, 16)
    unchanged(matmul.MmReshapeBias(), lambda x, w, b: (x @ w).view(2, 16) + b, x, w, b)


def test_mm_result_used_elsewhere_is_left_alone(unchanged) -> None:
    x, w, b = (
        _randn(torch.float32, 2, 5, 16),
        _randn(torch.float32, 16, 8),
        _randn(torch.float32, 8),
    )

    def both(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        y = x @ w
        return (y + b) * y

    unchanged(matmul.MmReshapeBias(), both, x, w, b)


# --- transpose absorption ----------------------------------------------------------------------


def test_materialised_transposes_feeding_mm_are_dropped(rewrite) -> None:
    a, w = _randn(torch.float32, 16, 6), _randn(torch.float32, 8, 16, seed=1)
    count, before, after = rewrite(
        matmul.MmTranspose(), lambda a, w: a.t().contiguous() @ w.t().contiguous(), a, w
    )
    assert count == 1
    assert (before[CLONE], after[CLONE], after[MM], after["aten.permute.default"]) == (2, 0, 1, 2)


def test_transposes_in_bf16_are_left_alone(unchanged) -> None:
    """Without native bf16 GEMM the CPU's speed depends on the operands' layout (up to 8x)."""
    a, w = _randn(torch.bfloat16, 16, 6), _randn(torch.bfloat16, 8, 16, seed=1)
    unchanged(matmul.MmTranspose(), lambda a, w: a.t().contiguous() @ w.t().contiguous(), a, w)


def test_transpose_feeding_addmm_and_bmm_is_dropped(rewrite) -> None:
    x, w, b = _randn(torch.float32, 4, 16), _randn(torch.float32, 8, 16), _randn(torch.float32, 8)
    count, _, after = rewrite(
        matmul.MmTranspose(), lambda x, w, b: torch.addmm(b, x, w.t().contiguous()), x, w, b
    )
    assert (count, after[CLONE], after[ADDMM]) == (1, 0, 1)
    q, k = _randn(torch.float32, 3, 5, 16), _randn(torch.float32, 3, 7, 16)
    count, _, after = rewrite(
        matmul.MmTranspose(), lambda q, k: torch.bmm(q, k.transpose(1, 2).contiguous()), q, k
    )
    assert (count, after[CLONE], after[BMM]) == (1, 0, 1)


def test_one_transpose_copy_as_both_operands_is_dropped_once(rewrite) -> None:
    def square(x: torch.Tensor) -> torch.Tensor:
        xt = x.t().contiguous()
        return xt @ xt

    count, before, after = rewrite(matmul.MmTranspose(), square, _randn(torch.float32, 12, 12))
    assert (count, before[CLONE], after[CLONE], after[MM]) == (1, 1, 0, 1)


def test_transpose_copy_used_elsewhere_is_left_alone(rewrite) -> None:
    x, w = _randn(torch.float32, 4, 16), _randn(torch.float32, 8, 16)

    def shared(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wt = w.t().contiguous()
        return x @ wt, wt

    count, before, after = rewrite(matmul.MmTranspose(), shared, x, w)
    assert (count, after) == (0, before)


def test_copy_of_another_permutation_is_left_alone(unchanged) -> None:
    q, k = _randn(torch.float32, 5, 3, 16), _randn(torch.float32, 3, 16, 7)
    unchanged(
        matmul.MmTranspose(), lambda q, k: torch.bmm(q.permute(1, 0, 2).contiguous(), k), q, k
    )


# --- 2-D BMM → MM ------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rewrites"), [(torch.float32, 1), (torch.bfloat16, 0)])
def test_bmm_of_batch_one_becomes_mm_in_fp32(rewrite, dtype: torch.dtype, rewrites: int) -> None:
    a, b = _randn(dtype, 1, 6, 16), _randn(dtype, 1, 16, 8, seed=1)
    count, _, after = rewrite(matmul.BmmToMm(), torch.bmm, a, b)
    assert (count, after[BMM], after[MM]) == (rewrites, 1 - rewrites, rewrites)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_with_one_broadcast_matrix_becomes_one_mm(rewrite, dtype: torch.dtype) -> None:
    a, w = _randn(dtype, 3, 6, 16), _randn(dtype, 16, 8, seed=1)
    count, _, after = rewrite(matmul.BmmToMm(), lambda a, w: torch.bmm(a, w.expand(3, 16, 8)), a, w)
    assert (count, after[BMM], after[MM]) == (1, 0, 1)


@pytest.mark.parametrize(
    ("make", "left"),
    [
        pytest.param(
            lambda a, w: torch.bmm(a, w.unsqueeze(0).repeat(3, 1, 1)),
            (3, 6, 16),
            id="batch of copies",
        ),
        pytest.param(
            lambda a, w: torch.bmm(a.transpose(0, 1), w.expand(3, 16, 8)),
            (6, 3, 16),
            id="left not foldable",
        ),
        pytest.param(  # no b[0] to take (the pass's select failed the compile)
            lambda a, w: torch.bmm(a, w.expand(0, 16, 8)),
            (0, 6, 16),
            id="empty batch",
        ),
    ],
)
def test_bmm_that_needs_its_batch_is_left_alone(
    unchanged, make: Callable[..., torch.Tensor], left: tuple[int, ...]
) -> None:
    unchanged(matmul.BmmToMm(), make, _randn(torch.float32, *left), _randn(torch.float32, 16, 8))


def test_bmm_of_an_expanded_left_operand_is_left_alone(unchanged) -> None:
    a, w = _randn(torch.float32, 6, 16), _randn(torch.float32, 16, 8)
    unchanged(
        matmul.BmmToMm(), lambda a, w: torch.bmm(a.expand(3, 6, 16), w.expand(3, 16, 8)), a, w
    )


# --- K = 1 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_mm_with_inner_dimension_one_is_a_broadcast_multiply(rewrite, dtype: torch.dtype) -> None:
    a, b = _randn(dtype, 64, 1), _randn(dtype, 1, 32, seed=1)
    count, _, after = rewrite(matmul.MmK1(), lambda a, b: torch.relu(a @ b), a, b)
    assert (count, after[MM], after[MUL]) == (1, 0, 1)
    gm = _trace(lambda a, b: torch.relu(a @ b), a, b)
    matmul.MmK1()(gm)
    gm.recompile()
    assert torch.equal(gm(a, b), torch.relu(a @ b)), "one product per element: bitwise equal"


def test_mm_with_inner_dimension_two_is_left_alone(unchanged) -> None:
    a, b = _randn(torch.float32, 64, 2), _randn(torch.float32, 2, 32)
    unchanged(matmul.MmK1(), lambda a, b: torch.relu(a @ b), a, b)


def _scaled_and_max(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return y * 2, y.amax()


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(lambda a, b: a @ b, id="graph output"),
        pytest.param(lambda a, b: (a @ b).sum(0), id="reduction user"),
        pytest.param(lambda a, b: _scaled_and_max(a @ b), id="one user not pointwise"),
    ],
)
def test_k1_mm_without_only_pointwise_users_is_left_alone(
    unchanged, fn: Callable[..., Any]
) -> None:
    a, b = _randn(torch.float32, 64, 1), _randn(torch.float32, 1, 32)
    unchanged(matmul.MmK1(), fn, a, b)


# --- cast absorption (not registered) ----------------------------------------------------------


def test_upcast_mm_downcast_becomes_the_narrow_mm(rewrite) -> None:
    a, w = _randn(torch.bfloat16, 6, 16), _randn(torch.bfloat16, 8, 16, seed=1)
    count, before, after = rewrite(
        matmul.MmCast(), lambda a, w: (a.float() @ w.float().t()).bfloat16(), a, w
    )
    assert (count, before[CONVERT], after[CONVERT], after[MM]) == (1, 3, 0, 1)
    node = next(n for n in _trace(torch.mm, a, w.t()).graph.nodes if str(n.target) == MM)
    assert node.meta["val"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("fn", "dtype"),
    [
        pytest.param(
            lambda a, w: (a.bfloat16() @ w.bfloat16()).float(), torch.float32, id="down then up"
        ),
        pytest.param(lambda a, w: a.float() @ w.float(), torch.bfloat16, id="fp32 result kept"),
        pytest.param(
            lambda a, w: (a.float() @ w.float()).bfloat16(), torch.float32, id="fp32 operand"
        ),
        pytest.param(
            lambda a, w: (a.float() @ w.float()).half(), torch.bfloat16, id="other narrow dtype"
        ),
    ],
)
def test_casts_that_change_the_values_are_left_alone(
    unchanged, fn: Callable[..., torch.Tensor], dtype: torch.dtype
) -> None:
    a, w = _randn(torch.bfloat16, 6, 16).to(dtype), _randn(torch.bfloat16, 16, 8, seed=1)
    unchanged(matmul.MmCast(), fn, a, w)


def test_upcast_used_elsewhere_is_left_alone(rewrite) -> None:
    a, w = _randn(torch.bfloat16, 6, 16), _randn(torch.bfloat16, 16, 8, seed=1)

    def shared(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        wide = a.float()
        return (wide @ w.float()).bfloat16(), wide.sum()

    count, before, after = rewrite(matmul.MmCast(), shared, a, w)
    assert (count, after) == (0, before)


def test_registered_passes_are_the_ones_that_measured_at_least_as_fast() -> None:
    names = {p.name for p in all_passes()}
    assert {"mm_reshape_bias", "mm_transpose", "bmm_to_mm", "mm_k1"} <= names
    assert "mm_cast" not in names
    for pass_ in matmul.PASSES:
        assert pass_.name
        assert pass_.version
        assert pass_.summary
        assert isinstance(pass_.priority, int)


def test_spore_passes_apply_runs_the_matmul_passes_in_order(
    assert_rel_close, spore_manager
) -> None:
    """Through the registry: bmm_to_mm (priority 40) turns the batch-1 bmm into an unsqueezed
    mm that mm_reshape_bias (20) then gives its bias; mm_transpose drops the weight copy."""
    from spore import passes

    spore_manager({"SPORE_PLUGINS": "mfusion"})

    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.bmm(x, w.unsqueeze(0)) + b, x[0] @ w.t().contiguous()

    x, w, b = (
        _randn(torch.float32, 1, 6, 16),
        _randn(torch.float32, 16, 16),
        _randn(torch.float32, 16),
    )
    gm = _trace(fn, x, w, b)
    counts = passes.apply(gm)
    mine = {f"mfusion.{p.name}" for p in matmul.PASSES}
    assert {k: v for k, v in counts.items() if k in mine} == {
        "mfusion.bmm_to_mm": 1,
        "mfusion.mm_k1": 0,
        "mfusion.mm_reshape_bias": 1,
        "mfusion.mm_transpose": 1,
    }
    ops = _ops(gm)
    assert (ops[BMM], ops[MM], ops[ADD], ops[CLONE], ops[ADDMM]) == (0, 1, 0, 0, 1)
    for got, want in zip(gm(x, w, b), fn(x, w, b), strict=True):
        assert_rel_close(got, want)
    assert not any(passes.apply(gm).values())


# --- real compiles (backend="spore") ------------------------------------------------------------


def test_compiled_nd_linear_gets_addmm_forward_and_backward(
    assert_rel_close, mfusion_compile
) -> None:
    x, w, b = (_randn(torch.float32, *s, seed=i) for i, s in enumerate([(2, 5, 16), (16, 8), (8,)]))
    got = [t.clone().requires_grad_() for t in (x, w, b)]
    want = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled = mfusion_compile(lambda x, w, b: x @ w + b, *got)
    expected = want[0] @ want[1] + want[2]
    assert_rel_close(compiled.outputs, expected)
    upstream = _randn(torch.float32, 2, 5, 8, seed=7)
    compiled.outputs.backward(upstream)
    expected.backward(upstream)
    for name, g, e in zip("xwb", got, want, strict=True):
        assert_rel_close(g.grad, e.grad, f"grad of {name}")
    # forward: the mm's only user is the view (the backward saves x and w), so it matches;
    # backward: grad_x and grad_w are plain mms and grad_b a sum, nothing to absorb
    assert len(compiled.graphs) == 2
    assert (compiled.count(ADDMM, 0), compiled.count(MM, 0), compiled.count(ADD, 0)) == (1, 0, 0)
    assert (compiled.count(ADDMM, 1), compiled.count(MM, 1)) == (0, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_matmuls_are_rewritten(
    assert_rel_close, mfusion_compile, dtype: torch.dtype
) -> None:
    def model(x, w_t, v, a, c):
        y = x @ w_t.t().contiguous()  # transpose absorption
        z = x.unsqueeze(0) @ v.unsqueeze(0)  # batch-1 bmm
        u = x.view(2, 3, 16) @ v.unsqueeze(0)  # bmm with a batch-broadcast right operand
        return y, z, u, torch.relu(a @ c)  # K = 1 feeding a pointwise op

    args = (
        _randn(dtype, 6, 16),
        _randn(dtype, 8, 16, seed=1),
        _randn(dtype, 16, 4, seed=2),
        _randn(dtype, 40, 1, seed=3),
        _randn(dtype, 1, 24, seed=4),
    )
    with torch.no_grad():
        compiled = mfusion_compile(model, *args)
        for got, want in zip(compiled.outputs, model(*args), strict=True):
            assert_rel_close(got, want)
    # bf16 keeps the transpose copy and the batch-1 bmm (layout-sensitive GEMM speed)
    wide = int(dtype == torch.float32)
    assert len(compiled.graphs) == 1
    assert compiled.count(CLONE) == 1 - wide
    assert compiled.count(BMM) == 1 - wide
    assert compiled.count(MM) == 2 + wide
    assert compiled.count(MUL) == 1


def test_mfusion_disable_switches_a_matmul_pass_off(
    assert_rel_close, mfusion_compile, monkeypatch
) -> None:
    monkeypatch.setenv("MFUSION_DISABLE", "mm_reshape_bias")
    x, w, b = (
        _randn(torch.float32, 2, 5, 16),
        _randn(torch.float32, 16, 8),
        _randn(torch.float32, 8),
    )
    with torch.no_grad():
        compiled = mfusion_compile(lambda x, w, b: x @ w + b, x, w, b)
        assert_rel_close(compiled.outputs, x @ w + b)
    assert (compiled.count(ADDMM), compiled.count(MM), compiled.count(ADD)) == (0, 1, 1)


def test_symbolic_shapes_rewrite_without_fixed_sizes(assert_rel_close) -> None:
    """Dynamic-shape graphs: the passes that need no new sizes rewrite, the folding view of a
    broadcast bmm (which would need them) is left alone; the graphs still run at other sizes."""
    decompositions = select_decomp_table()

    def symbolic(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
        return make_fx(fn, decomposition_table=decompositions, tracing_mode="symbolic")(*args)

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return x @ w.t().contiguous() + b

    x, w, b = (
        _randn(torch.float32, 2, 5, 16),
        _randn(torch.float32, 8, 16),
        _randn(torch.float32, 8),
    )
    gm = symbolic(linear, x, w, b)
    assert matmul.MmTranspose()(gm) == 1
    assert matmul.MmReshapeBias()(gm) == 1
    gm.recompile()
    assert (_ops(gm)[ADDMM], _ops(gm)[CLONE]) == (1, 0)
    other = (
        _randn(torch.float32, 3, 7, 12),
        _randn(torch.float32, 4, 12),
        _randn(torch.float32, 4),
    )
    assert_rel_close(gm(*other), linear(*other))

    a, c = _randn(torch.float32, 1, 6, 16), _randn(torch.float32, 1, 16, 8)
    gm = symbolic(torch.bmm, a, c)
    assert matmul.BmmToMm()(gm) == 1
    gm.recompile()
    a, c = _randn(torch.float32, 1, 9, 5), _randn(torch.float32, 1, 5, 3)
    assert_rel_close(gm(a, c), torch.bmm(a, c))

    gm = symbolic(lambda a, w: torch.bmm(a, w.expand(a.shape[0], -1, -1)), x, w.t())
    assert matmul.BmmToMm()(gm) == 0
