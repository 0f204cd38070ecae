"""gelu: the C++ CPU kernels against the plain-torch reference, float64 accuracy, and the op's
contract."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import gelu as op

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MODES = list(op.APPROXIMATIONS)
FLT_MIN = 2.0**-126


def _x(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _all_floats(limit: float, step: int) -> torch.Tensor:
    """Every step-th float32 in [0, limit], both signs."""
    top = torch.tensor([limit], dtype=torch.float32).view(torch.int32).item()
    x = torch.arange(0, top + 1, step, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([x, -x])


def _ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in units of the float32 ulp at exact (subnormals: the subnormal ulp)."""
    magnitude = exact.abs().float().clamp_min(FLT_MIN)
    _, exponent = torch.frexp(magnitude)
    ulp = torch.ldexp(torch.ones_like(exact), (exponent - 24).to(torch.float64))
    return (got.double() - exact).abs() / ulp


def _exact(x: torch.Tensor) -> torch.Tensor:
    """gelu in float64 through erfc, accurate to the last bit of float32 at every x."""
    xd = x.double()
    return 0.5 * xd * torch.special.erfc(-xd * math.sqrt(0.5))


def _exact_tanh(x: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return xd * torch.sigmoid(2 * op.TANH_K0 * (xd + op.TANH_K1 * xd.pow(3)))


@settings(max_examples=80, deadline=None)
@given(
    shape=st.sampled_from([(0,), (1,), (3, 0), (7,), (17,), (2, 33), (3, 5, 64), (13824,)]),
    dtype=st.sampled_from(list(TOL)),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference(shape, dtype, mode, seed) -> None:
    x = _x(shape, dtype, seed)
    assert op.supports(x, mode)
    out = torch.ops.spore.gelu(x, mode)
    assert out.dtype == dtype
    assert out.shape == x.shape
    torch.testing.assert_close(out, op.reference(x, mode), rtol=TOL[dtype], atol=TOL[dtype])
    g = _x(shape, dtype, seed + 1)
    dx = torch.ops.spore.gelu_backward(g, x, mode)
    expected = op.reference_backward(g, x, mode)
    torch.testing.assert_close(dx, expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("isa", _lib.available())
def test_exact_gelu_is_within_4_ulp_of_float64_everywhere(isa) -> None:
    """Every 97th float32 in [-20, 20] against erfc in float64: 4 ulp with FMA (v3, v4), 7 in
    the baseline build. torch's float32 F.gelu loses all digits below -4, where 1 + erf
    cancels; it is shown for contrast."""
    x = _all_floats(20.0, 97)
    exact = _exact(x)
    got = torch.empty_like(x)
    fwd = _lib.function("spore_gelu", op._FWD, _lib.load(isa))
    assert fwd(x.data_ptr(), got.data_ptr(), x.numel(), 0, 0, 2) == 0
    normal = exact.abs() >= FLT_MIN
    assert _ulps(got, exact)[normal].max() <= (4 if isa in ("v3", "v4") else 7)
    assert (got.double() - exact)[~normal].abs().max() <= 2.0**-146
    torch_ulps = _ulps(F.gelu(x), exact)[normal & (x < -4)]
    assert torch_ulps.max() > 1e6


def test_exact_gelu_agrees_with_torch_float64_gelu_where_that_is_accurate() -> None:
    x = _all_floats(20.0, 997)
    x = x[x > -4]
    assert _ulps(torch.ops.spore.gelu(x, "none"), F.gelu(x.double())).max() <= 4


def test_tanh_gelu_accuracy() -> None:
    """Within 3.5 ulp for x > -1, and a relative error below (2 |2y| + 8) 2^-23 everywhere: it
    grows in the negative tail as exp(-2y) amplifies the rounding of 2y."""
    x = _all_floats(20.0, 97)
    exact = _exact_tanh(x)
    got = torch.ops.spore.gelu(x, "tanh")
    normal = exact.abs() >= FLT_MIN
    assert _ulps(got, exact)[normal & (x > -1)].max() <= 3.5
    two_y = 2 * op.TANH_K0 * (x.double().abs() + op.TANH_K1 * x.double().abs().pow(3))
    rel = (got.double() - exact).abs() / exact.abs()
    assert (rel[normal] <= (2 * two_y[normal] + 8) * 2.0**-23).all()
    torch.testing.assert_close(got, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)


def test_gradients_are_accurate_in_float32() -> None:
    x = _all_floats(20.0, 4099)
    for mode, exact in (("none", _exact), ("tanh", _exact_tanh)):
        xd = x.double().requires_grad_()
        (dexact,) = torch.autograd.grad(exact(xd).sum(), xd)
        got = torch.ops.spore.gelu_backward(torch.ones_like(x), x, mode)
        torch.testing.assert_close(got.double(), dexact, rtol=1e-6, atol=1e-7)


def test_special_values() -> None:
    inf, nan = math.inf, math.nan
    x = torch.tensor([inf, -inf, nan, 0.0, -0.0, 17.0, -17.0, 1e30, -1e30, 3e38, -3e38])
    for mode in MODES:
        y = torch.ops.spore.gelu(x, mode)
        assert y[0] == inf
        assert y[1] == 0
        assert math.copysign(1, y[1].item()) == -1
        assert y[2].isnan()
        assert y[3] == 0
        assert math.copysign(1, y[3].item()) == 1
        assert y[4] == 0
        assert math.copysign(1, y[4].item()) == -1
        assert torch.equal(y[[5, 7, 9]], x[[5, 7, 9]])
        assert (y[[6, 8, 10]] == 0).all()
        d = torch.ops.spore.gelu_backward(torch.ones_like(x), x, mode)
        assert torch.equal(d[[0, 5, 7, 9]], torch.ones(4))
        assert (d[[1, 6, 8, 10]] == 0).all()
        assert d[2].isnan()
        torch.testing.assert_close(d[3:5], torch.full((2,), 0.5), rtol=0, atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_rounds_to_nearest_even_once(mode) -> None:
    x = _x((64, 256), torch.bfloat16, 3)
    exact = (_exact if mode == "none" else _exact_tanh)(x).to(torch.bfloat16)
    mismatches = (torch.ops.spore.gelu(x, mode) != exact).sum().item()
    assert mismatches <= x.numel() * 0.001, f"{mismatches} values differ from one rounding"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_16_bit_results_are_the_float32_kernel_rounded_once(dtype, mode) -> None:
    """Every one of the 65536 inputs: bitwise the float32 kernel's result, rounded."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    out = torch.ops.spore.gelu(x, mode)
    expected = torch.ops.spore.gelu(x.float(), mode).to(dtype)
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (out.isnan() & expected.isnan())
    assert same.all()


def test_threads_do_not_change_the_result() -> None:
    x = _x((1 << 17,), torch.float32, 4)
    outs = []
    for threads in (1, 2, 3):
        y = torch.empty_like(x)
        args = (x.data_ptr(), y.data_ptr(), x.numel(), 0, 0, threads)
        _lib.call("spore_gelu", op._FWD, *args)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])


def test_non_contiguous_and_float64_use_the_reference() -> None:
    x = _x((8, 32), torch.float32, 5)
    strided = x.t()
    assert dispatch.explain("gelu", strided, "none").chosen == "reference"
    torch.testing.assert_close(torch.ops.spore.gelu(strided, "none"), op.reference(strided))
    assert dispatch.explain("gelu", x.double(), "none").chosen == "reference"
    assert dispatch.explain("gelu", x, "tanh").chosen == "kernels"
    assert dispatch.explain("gelu_backward", x, x, "none").chosen == "kernels"


@pytest.mark.parametrize("mode", MODES)
def test_the_reference_s_derivative_is_one_at_the_top_as_the_kernel_s(mode) -> None:
    """Where gelu is x its derivative is 1: the references (float64 and transforms run them)
    gave NaN at +inf (``x * exp(-x*x/2)`` is inf * 0) and, in the tanh form, at large finite
    x (its derivative's cube overflows, times a 0 sigmoid)."""
    x = torch.tensor([9e3, 1e4, 1.5e4, 1e20, 3e38, math.inf])
    ones = torch.ones_like(x)
    assert torch.equal(torch.ops.spore.gelu_backward(ones, x, mode), ones)  # the kernel
    assert torch.equal(op.reference_backward(ones, x, mode), ones)
    assert torch.equal(op.reference_backward(ones.double(), x.double(), mode), ones.double())
    assert torch.equal(op.reference(x, mode), x)
    slope = torch.func.vmap(torch.func.grad(lambda t: torch.ops.spore.gelu(t, mode)))(x)
    assert torch.equal(slope, ones)


@pytest.mark.parametrize("mode", MODES)
def test_the_reference_keeps_the_negative_tail_under_transforms(mode) -> None:
    """torch.func transforms and forward AD run the reference, which was float32 F.gelu: its
    ``1 + erf`` (``1 + tanh``) cancels below x = -4, so vmap gave -0.0 where the kernel gives
    -5.9e-9, and torch.func.grad lost the derivative's every digit alike; the tanh form's
    ``sigmoid(2y)`` underflowed first; -inf gave NaN where the kernel gives -0."""

    def tail_exact(t: torch.Tensor) -> torch.Tensor:  # float64, no cancellation (F.gelu's
        if mode == "tanh":  # float64 1 + erf cancels too, below x = -8)
            return t * torch.sigmoid(2 * op.TANH_K0 * (t + op.TANH_K1 * t**3))
        return 0.5 * t * torch.erfc(-t / math.sqrt(2))

    x = torch.tensor([-4.0, -6.0, -8.0, -10.0, -10.3, -12.0])  # -10.3: sigmoid(2y) underflows
    exact = tail_exact(x.double())
    for got in (torch.func.vmap(lambda t: torch.ops.spore.gelu(t, mode))(x), op.reference(x, mode)):
        torch.testing.assert_close(got, exact.float(), rtol=2e-5, atol=1e-43)  # subnormals
    d64 = torch.func.vmap(torch.func.grad(tail_exact))(x.double()).float()
    slope = torch.func.vmap(torch.func.grad(lambda t: torch.ops.spore.gelu(t, mode)))(x)
    x_leaf = x.clone().requires_grad_()  # the older vmap runs gelu_backward's reference
    (batched,) = torch.autograd.grad(
        torch.ops.spore.gelu(x_leaf, mode), x_leaf, torch.eye(6), is_grads_batched=True
    )
    for got in (slope, batched.sum(0), op.reference_backward(torch.ones(6), x, mode)):
        torch.testing.assert_close(got, d64, rtol=2e-5, atol=1e-43)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    torch.testing.assert_close(
        op.reference(special, mode), torch.ops.spore.gelu(special, mode), equal_nan=True
    )


@pytest.mark.parametrize(
    ("x", "mode", "error", "message"),
    [
        (torch.ones(4, dtype=torch.int64), "none", TypeError, "floating-point"),
        (torch.ones(4), "sigmoid", ValueError, "approximate must be one of 'none', 'tanh'"),
        (torch.ones(4), "", ValueError, "got ''"),
    ],
)
def test_bad_input_is_a_clear_error(x, mode, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.gelu(x, mode)


def test_default_is_exact() -> None:
    x = _x((5, 9), torch.float32, 6)
    assert torch.equal(torch.ops.spore.gelu(x), torch.ops.spore.gelu(x, "none"))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_autograd_of_the_reference(mode) -> None:
    x = _x((4, 16), torch.float64, 7).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: torch.ops.spore.gelu(a, mode), (x,))
    x32 = x.detach().float().requires_grad_()
    torch.ops.spore.gelu(x32, mode).sum().backward()
    xr = x.detach().requires_grad_()
    op.reference(xr, mode).sum().backward()
    torch.testing.assert_close(x32.grad.double(), xr.grad, rtol=1e-5, atol=1e-6)


def test_compiles_fullgraph() -> None:
    x = _x((8, 64), torch.float32, 8)
    compiled = torch.compile(
        lambda a: torch.ops.spore.gelu(a, "tanh") + torch.ops.spore.gelu(a), fullgraph=True
    )
    torch.testing.assert_close(compiled(x), op.reference(x, "tanh") + op.reference(x))


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    fwd = _lib.function("spore_gelu", op._FWD, _lib.load(isa))
    bwd = _lib.function("spore_gelu_backward", op._BWD, _lib.load(isa))
    for dtype in TOL:
        x = _x((301,), dtype, 9)
        g = _x((301,), dtype, 10)
        for mode, name in enumerate(MODES):
            y, dx = torch.empty_like(x), torch.empty_like(x)
            code = _lib.dtype_code(x)
            assert fwd(x.data_ptr(), y.data_ptr(), 301, mode, code, 2) == 0
            assert bwd(g.data_ptr(), x.data_ptr(), dx.data_ptr(), 301, mode, code, 2) == 0
            tol = TOL[dtype]
            torch.testing.assert_close(y, op.reference(x, name), rtol=tol, atol=tol)
            torch.testing.assert_close(dx, op.reference_backward(g, x, name), rtol=tol, atol=tol)


def test_the_library_refuses_bad_arguments() -> None:
    fwd = _lib.function("spore_gelu", op._FWD)
    x = torch.ones(4)
    assert fwd(None, x.data_ptr(), 4, 0, 0, 1) == 1
    assert fwd(x.data_ptr(), x.data_ptr(), -1, 0, 0, 1) == 1
    assert fwd(x.data_ptr(), x.data_ptr(), 4, 2, 0, 1) == 1
    assert fwd(x.data_ptr(), x.data_ptr(), 4, 0, 0, 0) == 1
    assert fwd(x.data_ptr(), x.data_ptr(), 4, 0, 7, 1) == 2
    bwd = _lib.function("spore_gelu_backward", op._BWD)
    assert bwd(x.data_ptr(), None, x.data_ptr(), 4, 0, 0, 1) == 1
