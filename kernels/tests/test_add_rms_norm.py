"""add_rms_norm: the C++ CPU kernels against the plain-torch reference, and the op's contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import add_rms_norm as op
from spore_kernels.ops import rms_norm

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
COLS = [1, 2, 3, 7, 8, 15, 16, 17, 64, 129, 1000]


def _inputs(rows: int, cols: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    residual = (torch.randn(rows, cols, generator=g) * 2).to(dtype)
    w = torch.randn(cols, generator=g).to(dtype)
    return x, residual, w


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 9),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(list(TOL)),
    seed=st.integers(0, 2**16),
    eps=st.sampled_from([1e-6, 1e-5, 0.1]),
)
def test_kernel_matches_reference_and_the_contract(rows, cols, dtype, seed, eps) -> None:
    x, r, w = _inputs(rows, cols, dtype, seed)
    assert op.supports(x, r, w, eps)
    y, s = torch.ops.spore.add_rms_norm(x, r, w, eps)
    expected_y, expected_s = op.reference(x, r, w, eps)
    assert torch.equal(s, expected_s)
    assert y.dtype == s.dtype == dtype
    assert y.shape == s.shape == x.shape
    torch.testing.assert_close(y, expected_y, rtol=TOL[dtype], atol=TOL[dtype])
    # The contract: the sum is exactly torch's x + residual in the dtype, and y is spore's
    # rms_norm of that rounded sum (same kernel arithmetic: bitwise equal).
    assert torch.equal(s, x + r)
    assert torch.equal(y, torch.ops.spore.rms_norm(s, w, eps))


def test_the_norm_uses_the_rounded_sum() -> None:
    """In bf16, normalising the unrounded fp32 sum gives different values: the kernel does not."""
    x, r, w = _inputs(64, 256, torch.bfloat16, 1)
    y, s = torch.ops.spore.add_rms_norm(x, r, w, 1e-6)
    from_fp32_sum = rms_norm.reference(x.float() + r.float(), w.float(), 1e-6).bfloat16()
    assert (from_fp32_sum != y).sum().item() > 0
    assert torch.equal(y, torch.ops.spore.rms_norm(s, w, 1e-6))


def test_large_hidden_size_and_batch_dims() -> None:
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 3, 13824, generator=g), torch.randn(2, 3, 13824, generator=g)
    w = torch.randn(13824, generator=g)
    assert dispatch.explain("add_rms_norm", x, r, w, 1e-6).chosen == "kernels"
    y, s = torch.ops.spore.add_rms_norm(x, r, w, 1e-6)
    expected_y, expected_s = op.reference(x, r, w, 1e-6)
    torch.testing.assert_close(y, expected_y)
    assert torch.equal(s, expected_s)


def test_non_contiguous_and_mixed_dtypes_use_the_reference() -> None:
    x, r, w = _inputs(8, 32, torch.float32, 4)
    strided = x.t().contiguous().t()
    assert dispatch.explain("add_rms_norm", strided, r, w, 1e-6).chosen == "reference"
    y, s = torch.ops.spore.add_rms_norm(strided, r, w, 1e-6)
    expected_y, expected_s = op.reference(x, r, w, 1e-6)
    torch.testing.assert_close(y, expected_y)
    assert torch.equal(s, expected_s)
    assert dispatch.explain("add_rms_norm", x.double(), r.double(), w, 1e-6).chosen == "reference"
    assert dispatch.explain("add_rms_norm", x, r, w.half(), 1e-6).chosen == "reference"
    torch.testing.assert_close(
        torch.ops.spore.add_rms_norm(x, r, w.half(), 1e-6)[0],
        op.reference(x, r, w.half().float(), 1e-6)[0],
    )


@pytest.mark.parametrize(
    ("x", "r", "w", "error", "message"),
    [
        (torch.ones(2, 4, dtype=torch.int64), torch.ones(2, 4), torch.ones(4), TypeError, "x must"),
        (torch.ones(2, 4), torch.ones(2, 4).half(), torch.ones(4), TypeError, "x's dtype"),
        (torch.ones(2, 4), torch.ones(1, 4), torch.ones(4), ValueError, r"x's shape \(2, 4\)"),
        (torch.ones(2, 4), torch.ones(2, 4), torch.ones(3), ValueError, r"shape \(4,\)"),
        (torch.ones(()), torch.ones(()), torch.ones(()), ValueError, "at least one dimension"),
    ],
)
def test_bad_input_is_a_clear_error(x, r, w, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.add_rms_norm(x, r, w, 1e-6)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 9),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(list(TOL)),
    seed=st.integers(0, 2**16),
    with_grad_sum=st.booleans(),
)
def test_backward_kernel_matches_the_closed_form(rows, cols, dtype, seed, with_grad_sum) -> None:
    _, s, w = _inputs(rows, cols, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    grad = torch.randn(rows, cols, generator=g).to(dtype)
    grad_sum = torch.randn(rows, cols, generator=g).to(dtype) if with_grad_sum else None
    args = (grad, grad_sum, s, w, 1e-6)
    assert dispatch.explain("add_rms_norm_backward", *args).chosen == "kernels"
    ds, dw = torch.ops.spore.add_rms_norm_backward(*args)
    expected_ds, expected_dw = op.reference_backward(*args)
    tol = TOL[dtype] * 4
    torch.testing.assert_close(ds, expected_ds, rtol=tol, atol=tol)
    torch.testing.assert_close(dw, expected_dw, rtol=tol, atol=tol * max(rows, 1))


def test_gradients_match_autograd_of_the_reference_in_float64() -> None:
    x, r, w = _inputs(4, 16, torch.float64, 5)
    leaves = [t.requires_grad_() for t in (x, r, w)]
    assert torch.autograd.gradcheck(
        lambda a, b, c: torch.ops.spore.add_rms_norm(a, b, c, 1e-6), leaves
    )
    g = torch.Generator().manual_seed(6)
    gy, gs = (
        torch.randn(4, 16, generator=g, dtype=torch.float64),
        torch.randn(4, 16, generator=g, dtype=torch.float64),
    )
    ours = [t.detach().float().requires_grad_() for t in leaves]
    y, s = torch.ops.spore.add_rms_norm(*ours, 1e-6)
    torch.autograd.backward([y, s], [gy.float(), gs.float()])
    theirs = [t.detach().requires_grad_() for t in leaves]
    ry, rs = op.reference(*theirs, 1e-6)
    torch.autograd.backward([ry, rs], [gy, gs])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)


def test_x_and_residual_get_equal_independent_gradients() -> None:
    x, r, w = (t.requires_grad_() for t in _inputs(3, 40, torch.float32, 7))
    y, s = torch.ops.spore.add_rms_norm(x, r, w, 1e-6)
    (y.sum() + (s * 2).sum()).backward()
    assert torch.equal(x.grad, r.grad)
    before = r.grad.clone()
    x.grad.add_(1.0)
    assert torch.equal(r.grad, before)


@pytest.mark.parametrize("output", [0, 1])
def test_gradient_through_one_output_only(output) -> None:
    x, r, w = (t.requires_grad_() for t in _inputs(3, 40, torch.float32, 8))
    torch.ops.spore.add_rms_norm(x, r, w, 1e-6)[output].pow(2).sum().backward()
    xr, rr, wr = (t.detach().double().requires_grad_() for t in (x, r, w))
    op.reference(xr, rr, wr, 1e-6)[output].pow(2).sum().backward()
    for a, b in ((x, xr), (r, rr)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-4)
    if output == 1:
        assert w.grad is None or torch.count_nonzero(w.grad) == 0
    else:
        torch.testing.assert_close(w.grad.double(), wr.grad, rtol=1e-4, atol=1e-4)


def test_backward_of_empty_rows_has_empty_gradients() -> None:
    x, r, w = (torch.randn(*s, requires_grad=True) for s in ((3, 0), (3, 0), (0,)))
    y, s = torch.ops.spore.add_rms_norm(x, r, w, 1e-6)
    (y.sum() + s.sum()).backward()
    assert x.grad.shape == r.grad.shape == (3, 0)
    assert w.grad.shape == (0,)


def test_compiles_fullgraph_forward_and_backward() -> None:
    x, r, w = _inputs(8, 64, torch.float32, 9)

    def block(a, b, c):
        y, s = torch.ops.spore.add_rms_norm(a, b, c, 1e-6)
        return y * 2 + s

    compiled = torch.compile(block, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    compiled(*leaves).sum().backward()
    eager = [t.clone().requires_grad_() for t in (x, r, w)]
    ey, es = op.reference(*eager, 1e-6)
    (ey * 2 + es).sum().backward()
    for a, b in zip(leaves, eager, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled(x, r, w), block(x, r, w))


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    fn = _lib.function("spore_add_rms_norm", op._FWD, _lib.load(isa))
    for dtype in TOL:
        x, r, w = _inputs(5, 301, dtype, 10)
        y, s = torch.empty_like(x), torch.empty_like(x)
        ptrs = (x.data_ptr(), r.data_ptr(), w.data_ptr(), y.data_ptr(), s.data_ptr())
        assert fn(*ptrs, 5, 301, 1e-6, _lib.dtype_code(x), 2) == 0
        expected_y, expected_s = op.reference(x, r, w, 1e-6)
        torch.testing.assert_close(y, expected_y, rtol=TOL[dtype], atol=TOL[dtype])
        assert torch.equal(s, expected_s)


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_keeps_the_contract(isa) -> None:
    """Each build's y is bitwise that build's rms_norm of s, whatever its vector width."""
    lib = _lib.load(isa)
    fused = _lib.function("spore_add_rms_norm", op._FWD, lib)
    plain = _lib.function("spore_rms_norm", rms_norm._FWD, lib)
    for dtype in TOL:
        for cols in COLS:
            x, r, w = _inputs(9, cols, dtype, cols)
            y, s, expected_y = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
            code = _lib.dtype_code(x)
            ptrs = (x.data_ptr(), r.data_ptr(), w.data_ptr(), y.data_ptr(), s.data_ptr())
            assert fused(*ptrs, 9, cols, 1e-6, code, 2) == 0
            assert (
                plain(s.data_ptr(), w.data_ptr(), expected_y.data_ptr(), 9, cols, 1e-6, code, 2)
                == 0
            )
            assert torch.equal(s, x + r)
            assert torch.equal(y, expected_y)


def test_the_library_refuses_bad_arguments() -> None:
    fwd = _lib.function("spore_add_rms_norm", op._FWD)
    bwd = _lib.function("spore_add_rms_norm_backward", op._BWD)
    t = torch.ones(4)
    p = t.data_ptr()
    assert fwd(None, p, p, p, p, 1, 4, 1e-6, 0, 1) == 1
    assert fwd(p, p, p, p, p, 1, 0, 1e-6, 0, 1) == 1
    assert fwd(p, p, p, p, p, 1, 4, 1e-6, 7, 1) == 2
    assert fwd(p, p, p, p, p, 1, 4, 1e-6, 0, 0) == 1
    assert bwd(p, None, None, p, p, p, 1, 4, 1e-6, 0, 1) == 1
    assert bwd(p, None, p, p, p, p, -1, 4, 1e-6, 0, 1) == 1
    assert bwd(p, None, p, p, p, p, 1, 4, 1e-6, 3, 1) == 2
