"""mean_var: the C++ CPU kernels against the plain-torch reference and torch.var_mean."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import mean_var as op

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
SIZES = st.sampled_from([0, 1, 2, 3, 5, 8, 17, 33, 64, 65, 130])


def _x(shape, dtype: torch.dtype, seed: int, offset: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2 + offset).to(dtype)


def _close(got, expected, dtype) -> None:
    torch.testing.assert_close(got, expected, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)


@st.composite
def cases(draw):
    shape = draw(st.lists(SIZES, min_size=1, max_size=4).filter(lambda s: _numel(s) <= 40_000))
    dim = draw(st.integers(-len(shape), len(shape) - 1))
    return shape, dim


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


@settings(max_examples=100, deadline=None)
@given(
    case=cases(),
    dtype=st.sampled_from(list(TOL)),
    correction=st.sampled_from([0, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_and_var_mean(case, dtype, correction, seed) -> None:
    shape, dim = case
    x = _x(shape, dtype, seed)
    assert op.supports(x, dim, correction)
    mean, var = torch.ops.spore.mean_var(x, dim, correction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when n - correction <= 0
        ref_mean, ref_var = op.reference(x, dim, correction)
        torch_var, torch_mean = torch.var_mean(x, dim, correction=correction)
    assert mean.dtype == var.dtype == dtype
    assert mean.shape == var.shape == ref_mean.shape
    _close(mean, ref_mean, dtype)
    _close(var, ref_var, dtype)
    _close(mean, torch_mean, dtype)
    _close(var, torch_var, dtype)


@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        ((3_000_000,), 0),  # one row, split across threads, segments merged pairwise
        ((2, 1_500_000), -1),
        ((400_000, 5), 0),  # columns: one Welford state per column
        ((3, 70_000, 17), 1),
        ((20_000, 4099), 0),  # more than one block of columns
    ],
)
def test_long_reductions_stay_accurate(shape, dim) -> None:
    """Long reductions in fp32 (a large mean) agree with float64 to about one rounding, forward
    and backward (the backward's mean: fp32 sums per segment, double across segments)."""
    x = _x(shape, torch.float32, 1, offset=5.0)
    mean, var = torch.ops.spore.mean_var(x, dim)
    exact_var, exact_mean = torch.var_mean(x.double(), dim)
    torch.testing.assert_close(mean.double(), exact_mean, rtol=5e-7, atol=0)
    torch.testing.assert_close(var.double(), exact_var, rtol=2e-6, atol=0)
    g = torch.Generator().manual_seed(2)
    grad_mean, grad_var = torch.randn(mean.shape, generator=g), torch.randn(var.shape, generator=g)
    dx = torch.ops.spore.mean_var_backward(grad_mean, grad_var, x, dim, 1)
    exact = op.reference_backward(grad_mean.double(), grad_var.double(), x.double(), dim, 1)
    torch.testing.assert_close(dx.double(), exact, rtol=1e-5, atol=1e-9)


def test_zero_divisor_and_empty_dimension_match_torch() -> None:
    x = _x((4, 3), torch.float32, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for correction in (3, 4, 7):  # n - correction <= 0: inf or NaN like torch
            mean, var = torch.ops.spore.mean_var(x, 1, correction)
            torch_var, torch_mean = torch.var_mean(x, 1, correction=correction)
            torch.testing.assert_close(var, torch_var, equal_nan=True)
            assert torch.isinf(var).all() or torch.isnan(var).all()
        empty = torch.ones(3, 0)
        mean, var = torch.ops.spore.mean_var(empty, 1)
        torch_var, torch_mean = torch.var_mean(empty, 1)
    assert mean.shape == (3,)
    assert torch.isnan(mean).all()
    assert torch.isnan(var).all()
    torch.testing.assert_close(mean, torch_mean, equal_nan=True)
    ones = torch.ones(5, 2)
    mean, var = torch.ops.spore.mean_var(ones, 0, 1)
    assert torch.equal(var, torch.zeros(2))
    assert torch.equal(mean, torch.ones(2))


def test_non_finite_inputs_match_var_mean() -> None:
    """Welford turns an infinite value into a NaN mean, as torch.var_mean does (x.mean() would
    give inf); NaN propagates to both outputs."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[inf, 1.0, 2.0], [1.0, nan, 3.0], [-inf, -inf, 0.0], [1.0, 2.0, 4.0]])
    mean, var = torch.ops.spore.mean_var(x, -1)
    torch_var, torch_mean = torch.var_mean(x, -1)
    torch.testing.assert_close(mean, torch_mean, equal_nan=True)
    torch.testing.assert_close(var, torch_var, equal_nan=True)
    assert torch.isnan(mean[:3]).all()
    assert torch.isfinite(mean[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the kernel; the reference
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_inputs_match_var_mean_backward(dtype, bad) -> None:
    """The reference centred a row twice: the second mean, NaN, made the row's other gradients
    NaN where torch's (and the kernel's) are ±inf."""
    x = torch.arange(12.0, dtype=dtype).reshape(4, 3)
    x[1, 1] = bad
    leaf = x.clone().requires_grad_()
    var, mean = torch.var_mean(leaf, 0, correction=1)
    (var.sum() + mean.sum()).backward()
    ones = torch.ones(3, dtype=dtype)
    spore = torch.ops.spore.mean_var_backward(ones, ones, x, 0, 1)  # float32: the kernel
    for dx in (op.reference_backward(ones, ones, x, 0, 1), spore):
        torch.testing.assert_close(dx, leaf.grad, equal_nan=True)


def test_scalar_input_uses_the_reference() -> None:
    x = torch.tensor(3.0)
    assert dispatch.explain("mean_var", x, 0, 0).chosen == "reference"
    mean, var = torch.ops.spore.mean_var(x, -1, 0)
    assert mean.item() == 3.0
    assert var.item() == 0.0


def test_non_contiguous_and_float64_use_the_reference() -> None:
    x = _x((8, 32), torch.float32, 3)
    strided = x.t()
    assert dispatch.explain("mean_var", strided, 1).chosen == "reference"
    for got, expected in zip(
        torch.ops.spore.mean_var(strided, 1), op.reference(x.t(), 1), strict=True
    ):
        torch.testing.assert_close(got, expected)
    assert dispatch.explain("mean_var", x.double(), 1).chosen == "reference"
    assert dispatch.explain("mean_var", x, 1).chosen == "kernels"


@pytest.mark.parametrize(
    ("x", "dim", "correction", "error", "message"),
    [
        (torch.ones(2, 4, dtype=torch.int64), 0, 1, TypeError, "floating-point"),
        (torch.ones(2, 4), 2, 1, IndexError, r"use a dim in \[-2, 1\]"),
        (torch.ones(2, 4), -3, 1, IndexError, "out of range"),
        (torch.ones(2, 4), 0, -1, ValueError, "correction must be >= 0"),
    ],
)
def test_bad_input_is_a_clear_error(x, dim, correction, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.mean_var(x, dim, correction)


@settings(max_examples=100, deadline=None)
@given(
    case=cases(),
    dtype=st.sampled_from(list(TOL)),
    correction=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
    upstream=st.sampled_from(["both", "mean", "var"]),
)
def test_backward_kernel_matches_the_closed_form(case, dtype, correction, seed, upstream) -> None:
    shape, dim = case
    x = _x(shape, dtype, seed)
    reduced = [s for i, s in enumerate(shape) if i != dim % len(shape)]
    g = torch.Generator().manual_seed(seed + 1)
    grad_mean = torch.randn(reduced, generator=g).to(dtype) if upstream != "var" else None
    grad_var = torch.randn(reduced, generator=g).to(dtype) if upstream != "mean" else None
    args = (grad_mean, grad_var, x, dim, correction)
    assert dispatch.explain("mean_var_backward", *args).chosen == "kernels"
    dx = torch.ops.spore.mean_var_backward(*args)
    assert dx.shape == x.shape
    assert dx.dtype == dtype
    expected = op.reference_backward(*args)
    tol = TOL[dtype] * 4
    torch.testing.assert_close(dx, expected, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize(("shape", "dim"), [((3, 7), 1), ((3, 7), 0), ((2, 5, 3), -2)])
def test_gradients_match_autograd_in_float64(shape, dim, correction) -> None:
    x = _x(shape, torch.float64, 4).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: torch.ops.spore.mean_var(t, dim, correction), (x,))
    g = torch.Generator().manual_seed(5)
    reduced = [s for i, s in enumerate(shape) if i != dim % len(shape)]
    gm, gv = torch.randn(reduced, generator=g), torch.randn(reduced, generator=g)
    ours = x.detach().float().requires_grad_()
    torch.autograd.backward(
        list(torch.ops.spore.mean_var(ours, dim, correction)), [gm.float(), gv.float()]
    )
    theirs = x.detach().requires_grad_()
    torch.autograd.backward(
        [theirs.mean(dim), theirs.var(dim, correction=correction)], [gm.double(), gv.double()]
    )
    torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-4, atol=1e-4)


def test_gradient_through_one_output_only() -> None:
    x = _x((4, 9), torch.float32, 6).requires_grad_()
    torch.ops.spore.mean_var(x, 1)[1].sum().backward()
    expected = x.detach().double().requires_grad_()
    expected.var(1).sum().backward()
    torch.testing.assert_close(x.grad.double(), expected.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the kernel, the reference
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("shape", "dim", "correction"), [((4, 2), 1, 2), ((1, 8), 0, 1)])
def test_the_mean_alone_has_its_gradient_where_the_variance_divides_by_zero(
    dtype, compiled, shape, dim, correction
) -> None:
    """n - correction == 0 makes the variance's gradient scale infinite; the mean used alone
    still gets 1/n (the unused variance's zero gradient must not turn it into NaN)."""
    x = _x(shape, torch.float32, 8).to(dtype)

    def mean_only(t):
        return torch.ops.spore.mean_var(t, dim, correction)[0].sum()

    torch._dynamo.reset()  # a fresh, static compile (a recompile would mark sizes dynamic)
    leaf = x.clone().requires_grad_()
    (torch.compile(mean_only, fullgraph=True) if compiled else mean_only)(leaf).backward()
    expected = x.clone().requires_grad_()
    torch.var_mean(expected, dim, correction=correction)[1].sum().backward()
    torch.testing.assert_close(leaf.grad, expected.grad)


def test_compiles_fullgraph_forward_and_backward() -> None:
    x = _x((8, 64), torch.float32, 7)

    def fn(t):
        mean, var = torch.ops.spore.mean_var(t, -1)
        return mean * 2 + var

    compiled = torch.compile(fn, fullgraph=True)
    leaf = x.clone().requires_grad_()
    compiled(leaf).sum().backward()
    eager = x.clone().requires_grad_()
    (eager.mean(-1) * 2 + eager.var(-1)).sum().backward()
    torch.testing.assert_close(leaf.grad, eager.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled(x), fn(x))


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    fwd = _lib.function("spore_mean_var", op._FWD, _lib.load(isa))
    bwd = _lib.function("spore_mean_var_backward", op._BWD, _lib.load(isa))
    for dtype in TOL:
        for outer, n, inner in ((3, 301, 1), (2, 150, 37), (1, 70_000, 1)):
            x = _x((outer, n, inner), dtype, 8)
            mean, var = x.new_empty(outer, inner), x.new_empty(outer, inner)
            code = _lib.dtype_code(x)
            ptrs = (x.data_ptr(), mean.data_ptr(), var.data_ptr())
            assert fwd(*ptrs, outer, n, inner, 1, code, 2) == 0
            ref_mean, ref_var = op.reference(x, 1)
            _close(mean, ref_mean, dtype)
            _close(var, ref_var, dtype)
            dx = torch.empty_like(x)
            ptrs = (mean.data_ptr(), var.data_ptr(), x.data_ptr(), dx.data_ptr())
            assert bwd(*ptrs, outer, n, inner, 1, code, 2) == 0
            expected = op.reference_backward(mean, var, x, 1, 1)
            torch.testing.assert_close(dx, expected, rtol=TOL[dtype] * 4, atol=TOL[dtype] * 4)


def test_the_library_refuses_bad_arguments() -> None:
    fwd = _lib.function("spore_mean_var", op._FWD)
    bwd = _lib.function("spore_mean_var_backward", op._BWD)
    p = torch.ones(4).data_ptr()
    assert fwd(None, p, p, 1, 4, 1, 1, 0, 1) == 1
    assert fwd(p, p, p, 1, 4, 0, 1, 0, 1) == 1  # inner < 1
    assert fwd(p, p, p, 1, 4, 1, -1, 0, 1) == 1  # negative correction
    assert fwd(p, p, p, 1, 4, 1, 1, 4, 1) == 2
    assert fwd(p, p, p, 1, 4, 1, 1, 0, 0) == 1
    assert bwd(None, None, None, p, 1, 4, 1, 1, 0, 1) == 1
    assert bwd(None, None, p, p, 1, 0, 1, 1, 0, 1) == 1  # n < 1
    assert bwd(None, None, p, p, 1, 4, 1, 1, 3, 1) == 2


@pytest.mark.parametrize(
    ("shape", "dim"), [((3, 7), 1), ((3, 20_000), 1), ((300, 4), 0), ((5, 3000), 1)]
)
@pytest.mark.parametrize("offset", [1e3, 1e5, 1e7, 1e20])
def test_a_mean_far_from_zero_against_the_spread_stays_accurate(shape, dim, offset) -> None:
    """x = offset + randn (fp32): the kernel works on x less its first value, so the mean's
    rounding stays out of x - mean (it was 36 % off at 1e7; NaN at 1e20 with a spread of
    1e18); forward and backward against float64 on the same values."""
    g = torch.Generator().manual_seed(3)
    spread = 1e16 if offset > 1e19 else 1.0  # at 1e20 (x * x overflows fp32), m2 < 3e38
    x = offset + torch.randn(*shape, generator=g) * spread
    assert dispatch.explain("mean_var", x, dim).chosen == "kernels"
    mean, var = torch.ops.spore.mean_var(x, dim)
    exact_var, exact_mean = torch.var_mean(x.double(), dim)
    torch.testing.assert_close(mean.double(), exact_mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double(), exact_var, rtol=1e-4, atol=0)
    gm, gv = torch.randn(mean.shape, generator=g), torch.randn(var.shape, generator=g)
    dx = torch.ops.spore.mean_var_backward(gm, gv, x, dim, 1)
    exact = op.reference_backward(gm.double(), gv.double(), x.double(), dim, 1)
    scale = float(exact.abs().max())
    torch.testing.assert_close(dx.double(), exact, rtol=1e-4, atol=1e-4 * scale)


def test_the_reference_backward_centres_twice() -> None:
    """A non-contiguous x runs the reference backward, which centres x twice: a constant row of
    1e20 has x - mean = 0 (it gave 3e11 through the fp32 mean's rounding) and a mean far from
    the spread stays accurate (2e-4 of the gradient's size off at 300 + 0.05 randn; now 1e-7)."""
    constant = torch.full((37, 2), 1e20).t()
    ones = torch.ones(2)
    assert dispatch.explain("mean_var_backward", ones, ones, constant, 1, 1).chosen == "reference"
    dx = torch.ops.spore.mean_var_backward(ones, ones, constant, 1, 1)
    assert torch.equal(dx, torch.full((2, 37), 1 / 37))

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1000, 64, generator=g) * 0.05 + 300.0).t()
    gm, gv = torch.randn(64, generator=g), torch.randn(64, generator=g)
    dx = torch.ops.spore.mean_var_backward(gm, gv, x, 1, 1)
    exact = op.reference_backward(gm.double(), gv.double(), x.double(), 1, 1)
    scale = float(exact.abs().max())
    torch.testing.assert_close(dx.double(), exact, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize(("rows", "n"), [(2, 4096), (1, 65536), (2, 65536)])
def test_one_large_value_anywhere_costs_no_more_accuracy_than_in_torch(where, dim, rows, n) -> None:
    """One 1e4 among normal values, first, in the middle or last along the reduced dim (rows
    and columns; 65536 values are reduced in parts across threads, contiguous or strided):
    mean, variance and gradient against float64, within 3x torch's own error plus 1e-6 of
    their size (fp32 Welford's own rounding; with the first value as the kernels' pivot, the
    mean was off by 7000x torch's error)."""
    g = torch.Generator().manual_seed(4)
    at = {"first": 0, "middle": n // 2 - 1, "last": n - 1}[where]
    x = torch.randn(rows, n, generator=g)
    x[:, at] = 1e4
    x = x if dim == 1 else x.t().contiguous()
    gm, gv = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    assert dispatch.explain("mean_var", x, dim).chosen == "kernels"

    def errors(fn, dtype):
        leaf = x.to(dtype).requires_grad_()
        mean, var = fn(leaf)
        (grad,) = torch.autograd.grad((mean, var), leaf, (gm.to(dtype), gv.to(dtype)))
        others = torch.arange(n) != at
        return mean, var, grad[:, others] if dim == 1 else grad[others]

    ours = errors(lambda t: torch.ops.spore.mean_var(t, dim), torch.float32)
    theirs = errors(lambda t: torch.var_mean(t, dim)[::-1], torch.float32)
    exact = errors(lambda t: torch.var_mean(t, dim)[::-1], torch.float64)
    for name, a, t, e in zip(("mean", "var", "grad"), ours, theirs, exact, strict=True):
        error, torch_error = (a.double() - e).abs().max(), (t.double() - e).abs().max()
        bound = 3 * torch_error + 1e-6 * e.abs().max()
        assert error <= bound, f"{name}: {error:.3g} (torch {torch_error:.3g})"
