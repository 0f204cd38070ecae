"""layer_norm: the C++ CPU kernels against the plain-torch reference and F.layer_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import layer_norm as op

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
COLS = [1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 129, 1000]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int, affine=(True, True)):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3 + 1).to(dtype)
    w = torch.randn(cols, generator=g).to(dtype) if affine[0] else None
    b = torch.randn(cols, generator=g).to(dtype) if affine[1] else None
    return x, w, b


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(0, 9),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(list(TOL)),
    seed=st.integers(0, 2**16),
    eps=st.sampled_from([1e-5, 1e-6, 0.1]),
    affine=st.sampled_from(AFFINE),
)
def test_kernel_matches_reference_and_f_layer_norm(rows, cols, dtype, seed, eps, affine) -> None:
    x, w, b = _inputs(rows, cols, dtype, seed, affine)
    assert op.supports(x, w, b, eps)
    out = torch.ops.spore.layer_norm(x, w, b, eps)
    assert out.dtype == dtype
    assert out.shape == x.shape
    torch.testing.assert_close(out, op.reference(x, w, b, eps), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(
        out, F.layer_norm(x, (cols,), w, b, eps), rtol=TOL[dtype], atol=TOL[dtype]
    )


def test_rounds_once_in_bf16() -> None:
    """Computed in fp32 and rounded once: equal to the fp32 result rounded to bf16."""
    x, w, b = _inputs(64, 256, torch.bfloat16, 1)
    out = torch.ops.spore.layer_norm(x, w, b, 1e-5)
    exact = op.reference(x.float(), w.float(), b.float(), 1e-5).bfloat16()
    mismatches = (out != exact).sum().item()
    assert mismatches <= out.numel() * 0.001, f"{mismatches} values differ from one rounding"


def test_large_hidden_size_batch_dims_and_a_large_mean() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 13824, generator=g) + 1000.0  # two-pass statistics: no cancellation
    w, b = torch.randn(13824, generator=g), torch.randn(13824, generator=g)
    assert dispatch.explain("layer_norm", x, w, b, 1e-5).chosen == "kernels"
    out = torch.ops.spore.layer_norm(x, w, b, 1e-5)
    exact = op.reference(x.double(), w.double(), b.double(), 1e-5)
    # An fp32 mean is off by up to ulp(1000) / 2 = 3e-5 (torch's error); E[x^2] - E[x]^2 would
    # lose ~0.1.
    torch.testing.assert_close(out.double(), exact, rtol=1e-3, atol=1e-3)
    torch_error = (F.layer_norm(x, (13824,), w, b, 1e-5).double() - exact).abs().max()
    assert (out.double() - exact).abs().max() <= 2 * torch_error


def test_non_contiguous_and_mixed_dtypes_use_the_reference() -> None:
    x, w, b = _inputs(8, 32, torch.float32, 3)
    strided = x.t().contiguous().t()
    assert dispatch.explain("layer_norm", strided, w, b, 1e-5).chosen == "reference"
    torch.testing.assert_close(
        torch.ops.spore.layer_norm(strided, w, b, 1e-5), op.reference(x, w, b, 1e-5)
    )
    assert dispatch.explain("layer_norm", x.double(), None, None, 1e-5).chosen == "reference"
    assert dispatch.explain("layer_norm", x, w, b.half(), 1e-5).chosen == "reference"
    torch.testing.assert_close(
        torch.ops.spore.layer_norm(x.bfloat16(), w, b, 1e-5),
        F.layer_norm(x.bfloat16().float(), (32,), w, b, 1e-5).bfloat16(),
    )


def test_the_reference_centres_twice_like_the_kernel() -> None:
    """A non-contiguous x runs the reference, which centres each row twice as the kernel does:
    a constant row gives the bias exactly (it gave 2.4e-3 more: the fp32 mean's rounding,
    normalised) and a mean far from the spread stays accurate (it was 3e-3 off at 300 +
    0.05 randn; the kernel 1.4e-6), forward and backward against float64."""
    constant = torch.full((37, 2), 88.7).t()
    w, b = torch.ones(37), torch.randn(37, generator=torch.Generator().manual_seed(5))
    assert dispatch.explain("layer_norm", constant, w, b, 1e-5).chosen == "reference"
    assert torch.equal(torch.ops.spore.layer_norm(constant, w, b, 1e-5), b.expand(2, 37))

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(1000, 64, generator=g) * 0.05 + 300.0).t().requires_grad_()
    w, b, grad = (
        torch.randn(1000, generator=g),
        torch.randn(1000, generator=g),
        torch.randn(64, 1000, generator=g),
    )
    exact_x = x.detach().double().requires_grad_()
    exact = F.layer_norm(exact_x, (1000,), w.double(), b.double(), 1e-5)
    exact.backward(grad.double())
    out = torch.ops.spore.layer_norm(x, w, b, 1e-5)
    out.backward(grad)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5)
    scale = float(exact_x.grad.abs().max())
    torch.testing.assert_close(x.grad.double(), exact_x.grad, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize(
    ("x", "w", "b", "error", "message"),
    [
        (torch.ones(2, 4, dtype=torch.int32), None, None, TypeError, "x must be a floating"),
        (torch.ones(2, 4), torch.ones(4, dtype=torch.int64), None, TypeError, "weight must"),
        (torch.ones(2, 4), torch.ones(3), None, ValueError, r"weight must have shape \(4,\)"),
        (torch.ones(2, 4), None, torch.ones(2, 4), ValueError, r"bias must have shape \(4,\)"),
        (torch.ones(()), None, None, ValueError, "at least one dimension"),
    ],
)
def test_bad_input_is_a_clear_error(x, w, b, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.layer_norm(x, w, b, 1e-5)


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(0, 9),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(list(TOL)),
    seed=st.integers(0, 2**16),
    affine=st.sampled_from(AFFINE),
)
def test_backward_kernel_matches_the_closed_form(rows, cols, dtype, seed, affine) -> None:
    x, w, b = _inputs(rows, cols, dtype, seed, affine)
    grad = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    args = (grad, x, w, b, 1e-5)
    assert dispatch.explain("layer_norm_backward", *args).chosen == "kernels"
    got = torch.ops.spore.layer_norm_backward(*args)
    expected = op.reference_backward(*args)
    tol = TOL[dtype] * 4
    for name, a, e in zip(("dx", "dweight", "dbias"), got, expected, strict=True):
        if e is None:
            assert a is None, f"{name} must be None without its input"
        elif name == "dx":
            _check_dx(a, grad, x, w, tol)
        else:
            torch.testing.assert_close(a, e, rtol=tol, atol=tol * max(rows, 1))


def _check_dx(dx, grad, x, w, tol) -> None:
    """dx against the closed form in float64. dx = rstd (gw - mean(gw) - xhat mean(gw xhat))
    is a difference of terms of size rstd |gw| that cancel when a row's values are close
    (few columns: rstd is large), so a float32 result is off by about its epsilon times that
    size, not times |dx|: the bound scales with each row's rstd max |gw|."""
    w64 = None if w is None else w.double()
    exact = op.reference_backward(grad.double(), x.double(), w64, None, 1e-5)[0]
    xd = x.double()
    rstd = torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
    gw = grad.double() * (1.0 if w is None else w64)
    bound = tol * (rstd * gw.abs().amax(-1, keepdim=True) + exact.abs())
    err = (dx.double() - exact).abs()
    assert bool((err <= bound).all()), f"dx off by {(err / bound).max().item():.2f}x its bound"


@pytest.mark.parametrize("affine", AFFINE)
def test_gradients_match_autograd_of_the_reference_in_float64(affine) -> None:
    x, w, b = _inputs(4, 16, torch.float64, 4, affine)
    present = [t is not None for t in (x, w, b)]

    def args(*leaves):
        it = iter(leaves)
        return [next(it) if here else None for here in present]

    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    assert torch.autograd.gradcheck(  # batched: layer_norm_backward's optional results had
        lambda *ts: torch.ops.spore.layer_norm(*args(*ts), 1e-5),  # no fallback under the
        leaves,  # older vmap of autograd.grad(is_grads_batched=True)
        check_batched_grad=True,
    )
    ours = [t.detach().float().requires_grad_() for t in leaves]
    torch.ops.spore.layer_norm(*args(*ours), 1e-5).pow(2).sum().backward()
    theirs = [t.detach().requires_grad_() for t in leaves]
    a, c, d = args(*theirs)
    F.layer_norm(a, (16,), c, d, 1e-5).pow(2).sum().backward()
    for mine, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad.double(), expected.grad, rtol=1e-4, atol=1e-4)


def test_backward_of_empty_rows_matches_f_layer_norm() -> None:
    """A last dimension of size 0: empty gradients, as F.layer_norm's (the weight's and bias's
    sums over rows were a reshape that cannot infer its size)."""
    x, w, b = (torch.randn(*s, requires_grad=True) for s in ((3, 0), (0,), (0,)))
    torch.ops.spore.layer_norm(x, w, b, 1e-5).sum().backward()
    xt, wt, bt = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.layer_norm(xt, (0,), wt, bt, 1e-5).sum().backward()
    for ours, theirs in ((x, xt), (w, wt), (b, bt)):
        assert ours.grad.shape == theirs.grad.shape


def test_compiles_fullgraph_forward_and_backward() -> None:
    x, w, b = _inputs(8, 64, torch.float32, 5)

    def fn(a, c, d):
        return torch.ops.spore.layer_norm(a, c, d, 1e-5) * 2

    compiled = torch.compile(fn, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    compiled(*leaves).sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, w, b)]
    (F.layer_norm(eager[0], (64,), eager[1], eager[2], 1e-5) * 2).sum().backward()
    for a, e in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-4)
    no_affine = torch.compile(
        lambda a: torch.ops.spore.layer_norm(a, None, None, 1e-5), fullgraph=True
    )
    torch.testing.assert_close(no_affine(x), F.layer_norm(x, (64,), eps=1e-5))
    bias_only = torch.compile(
        lambda a, d: torch.ops.spore.layer_norm(a, None, d, 1e-5), fullgraph=True
    )
    leaves = [t.clone().requires_grad_() for t in (x, b)]
    bias_only(*leaves).pow(2).sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, b)]
    F.layer_norm(eager[0], (64,), None, eager[1], 1e-5).pow(2).sum().backward()
    for a, e in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    fwd = _lib.function("spore_layer_norm", op._FWD, _lib.load(isa))
    bwd = _lib.function("spore_layer_norm_backward", op._BWD, _lib.load(isa))
    for dtype in TOL:
        x, w, b = _inputs(5, 301, dtype, 6)
        y = torch.empty_like(x)
        code = _lib.dtype_code(x)
        assert (
            fwd(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 5, 301, 1e-5, code, 2) == 0
        )
        torch.testing.assert_close(y, op.reference(x, w, b, 1e-5), rtol=TOL[dtype], atol=TOL[dtype])
        g, dx, dw, db = (
            torch.ones_like(x),
            torch.empty_like(x),
            torch.empty_like(w),
            torch.empty_like(b),
        )
        ptrs = (g, x, w, dx, dw, db)
        assert bwd(*(t.data_ptr() for t in ptrs), 5, 301, 1e-5, code, 2) == 0
        tol = TOL[dtype] * 4
        for a, e in zip((dx, dw, db), op.reference_backward(g, x, w, b, 1e-5), strict=True):
            torch.testing.assert_close(a, e, rtol=tol, atol=tol * 5)


def test_the_library_refuses_bad_arguments() -> None:
    fwd = _lib.function("spore_layer_norm", op._FWD)
    bwd = _lib.function("spore_layer_norm_backward", op._BWD)
    p = torch.ones(4).data_ptr()
    assert fwd(None, None, None, p, 1, 4, 1e-5, 0, 1) == 1
    assert fwd(p, None, None, p, 1, 0, 1e-5, 0, 1) == 1
    assert fwd(p, None, None, p, 1, 4, 1e-5, 5, 1) == 2
    assert fwd(p, None, None, p, 1, 4, 1e-5, 0, 0) == 1
    assert bwd(p, p, None, p, p, None, 1, 4, 1e-5, 0, 1) == 1  # dweight without a weight
    assert bwd(p, None, None, p, None, None, 1, 4, 1e-5, 0, 1) == 1
    assert bwd(p, p, None, p, None, None, 1, 4, 1e-5, 9, 1) == 2


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_is_accurate_for_a_large_mean(isa) -> None:
    """The mean's magnitude costs no accuracy whatever the build's vector width."""
    fwd = _lib.function("spore_layer_norm", op._FWD, _lib.load(isa))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 13824, generator=g) + 1000.0
    w, b = torch.randn(13824, generator=g), torch.randn(13824, generator=g)
    y = torch.empty_like(x)
    ptrs = (x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr())
    assert fwd(*ptrs, 6, 13824, 1e-5, _lib.dtype_code(x), 2) == 0
    exact = op.reference(x.double(), w.double(), b.double(), 1e-5)
    torch_error = (F.layer_norm(x, (13824,), w, b, 1e-5).double() - exact).abs().max()
    assert (y.double() - exact).abs().max() <= 2 * torch_error


@pytest.mark.parametrize("isa", _lib.available())
@pytest.mark.parametrize("column", [0, 2047, 4095])
def test_every_installed_build_is_accurate_with_an_outlier_anywhere_in_the_row(isa, column) -> None:
    """One large value costs the row's other values about the accuracy it costs torch's,
    wherever it sits (with the row's first value as the kernel's shift, 100x more at column 0)."""
    fwd = _lib.function("spore_layer_norm", op._FWD, _lib.load(isa))
    bwd = _lib.function("spore_layer_norm_backward", op._BWD, _lib.load(isa))
    g = torch.Generator().manual_seed(4)
    x, w, b, grad = (torch.randn(n, generator=g) for n in ((2, 4096), 4096, 4096, (2, 4096)))
    x = x.view(2, 4096).clone()
    grad = grad.view(2, 4096)
    x[:, column] = 1e4
    y, dx, dw, db = (torch.empty_like(t) for t in (x, x, w, b))
    code = _lib.dtype_code(x)
    assert fwd(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 2, 4096, 1e-5, code, 2) == 0
    ptrs = (grad, x, w, dx, dw, db)
    assert bwd(*(t.data_ptr() for t in ptrs), 2, 4096, 1e-5, code, 2) == 0

    leaves = [t.double().requires_grad_() for t in (x, w, b)]
    exact = F.layer_norm(leaves[0], (4096,), *leaves[1:], 1e-5)
    exact_grads = torch.autograd.grad(exact, leaves, grad.double())
    eager = [t.clone().requires_grad_() for t in (x, w, b)]
    torch_y = F.layer_norm(eager[0], (4096,), *eager[1:], 1e-5)
    torch_grads = torch.autograd.grad(torch_y, eager, grad)
    others = torch.arange(4096) != column
    for ours, theirs, truth in zip(
        (y, dx, dw, db), (torch_y, *torch_grads), (exact, *exact_grads), strict=True
    ):
        error = (ours.double() - truth)[..., others].abs().max()
        assert error <= 3 * (theirs.double() - truth)[..., others].abs().max()
