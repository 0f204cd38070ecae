"""The Triton kernels (``spore_kernels.cuda``) against the ops' references.

Without a CUDA device the launchers run under Triton's interpreter on CPU tensors, which checks
the kernels' logic; with one, the same comparisons run through ``torch.ops.spore`` on CUDA
tensors (and dispatch must choose the kernel). Either way every kernel is also compiled ahead of
time for sm_90 (to PTX and cubin, no GPU needed), which the interpreter does not do.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

CUDA = torch.cuda.is_available()
if not CUDA:
    # Triton decides at import (of triton itself and of each @triton.jit) whether to interpret.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before test_triton.py could select its interpreter; "
            "run the tests with TRITON_INTERPRET=1 set"
        )
    os.environ["TRITON_INTERPRET"] = "1"

import triton.language as tl  # noqa: E402

from spore import dispatch  # noqa: E402
from spore_kernels import _checks, cuda, registration  # noqa: E402
from spore_kernels.cuda import _common  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = list(TOL)
FAST = settings(max_examples=12, deadline=None)


def ieee(test: Any) -> Any:
    """Silence the warnings for inf and NaN that a test produces on purpose (the interpreter
    computes with numpy, which warns on 0/0 and on exp overflowing to inf)."""
    for message in ("invalid value encountered", "divide by zero", "overflow encountered"):
        test = pytest.mark.filterwarnings(f"ignore:{message}:RuntimeWarning")(test)
    return test


@pytest.fixture(scope="module", autouse=True)
def interpreter_rounds_like_the_gpu():
    """Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even (the
    ``cvt.rn.bf16.f32`` that ``test_kernels_compile_for_sm90`` finds in the PTX): round like the
    GPU so that bf16 results are compared at the GPU's rounding."""
    if CUDA:
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_trunc

    def fp_trunc(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            wide = torch.from_numpy(np.ascontiguousarray(src.data))
            bits = wide.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return original(self, src, dst_type)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "create_fp_trunc", fp_trunc)
        yield


def _tree(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_tree(v, fn) for v in value)
    return value


def run(op: str, *args: Any) -> Any:
    """The Triton kernel's result for ``op`` on ``args`` (CPU tensors), returned on the CPU."""
    launcher, supports = cuda.kernels()[op]
    if CUDA:
        moved = _tree(args, lambda t: t.cuda())
        assert dispatch.explain(op, *moved).chosen == "kernels"
        return _tree(getattr(torch.ops.spore, op)(*moved), lambda t: t.cpu())
    assert supports(*args)
    return launcher(*args)


def reference(op: str, *args: Any) -> Any:
    return dispatch.get(op).reference(*args)


def assert_matches(out: Any, expected: Any, dtype: torch.dtype, scale: float = 1.0) -> None:
    outs = out if isinstance(out, tuple) else (out,)
    wanted = expected if isinstance(expected, tuple) else (expected,)
    assert len(outs) == len(wanted)
    for o, e in zip(outs, wanted, strict=True):
        if e is None:
            assert o is None
            continue
        assert o.dtype == e.dtype
        assert o.shape == e.shape
        tol = TOL[dtype] * scale
        torch.testing.assert_close(o, e, rtol=tol, atol=tol, equal_nan=True)


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


COLS = [1, 2, 7, 64, 129, 1000, _common.MAX_BLOCK + 3]


@FAST
@given(
    rows=st.integers(0, 4),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    eps=st.sampled_from([1e-6, 0.1]),
)
def test_rms_norm_and_backward(rows, cols, dtype, seed, eps) -> None:
    g = torch.Generator().manual_seed(seed)
    x, w = randn(g, rows, cols, dtype=dtype, scale=3), randn(g, cols, dtype=dtype)
    grad = randn(g, rows, cols, dtype=dtype)
    assert_matches(run("rms_norm", x, w, eps), reference("rms_norm", x, w, eps), dtype)
    expected = reference("rms_norm_backward", grad, x, w, eps)
    assert_matches(run("rms_norm_backward", grad, x, w, eps), expected, dtype, scale=10)


@pytest.mark.parametrize("op", ["rms_norm_backward", "layer_norm_backward"])
def test_weight_grads_sum_over_row_groups(op) -> None:
    """More rows than one row group of the weight/bias kernel: the partial sums must add up."""
    g = torch.Generator().manual_seed(7)
    x, w = randn(g, 70, 3, dtype=torch.float32), randn(g, 3, dtype=torch.float32)
    grad = randn(g, 70, 3, dtype=torch.float32)
    args = (grad, x, w, 1e-6) if op == "rms_norm_backward" else (grad, x, w, w + 1, 1e-6)
    assert_matches(run(op, *args), reference(op, *args), torch.float32, scale=10)


@FAST
@given(
    rows=st.integers(0, 4),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    with_grad_sum=st.booleans(),
)
def test_add_rms_norm_and_backward(rows, cols, dtype, seed, with_grad_sum) -> None:
    g = torch.Generator().manual_seed(seed)
    x, res = randn(g, rows, cols, dtype=dtype), randn(g, rows, cols, dtype=dtype)
    w = randn(g, cols, dtype=dtype)
    y, total = run("add_rms_norm", x, res, w, 1e-6)
    assert torch.equal(total, x + res)  # the residual stream: exactly torch's x + residual
    assert_matches((y, total), reference("add_rms_norm", x, res, w, 1e-6), dtype)
    grad = randn(g, rows, cols, dtype=dtype)
    grad_sum = randn(g, rows, cols, dtype=dtype) if with_grad_sum else None
    args = (grad, grad_sum, total, w, 1e-6)
    expected = reference("add_rms_norm_backward", *args)
    assert_matches(run("add_rms_norm_backward", *args), expected, dtype, scale=10)


@FAST
@given(
    rows=st.integers(0, 4),
    cols=st.sampled_from(COLS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    params=st.sampled_from(["both", "weight", "bias", "none"]),
)
def test_layer_norm(rows, cols, dtype, seed, params) -> None:
    g = torch.Generator().manual_seed(seed)
    x = randn(g, rows, cols, dtype=dtype, scale=2) + 5  # an offset the mean must remove
    w = randn(g, cols, dtype=dtype) if params in ("both", "weight") else None
    b = randn(g, cols, dtype=dtype) if params in ("both", "bias") else None
    assert_matches(run("layer_norm", x, w, b, 1e-5), reference("layer_norm", x, w, b, 1e-5), dtype)
    grad = randn(g, rows, cols, dtype=dtype)
    expected = reference("layer_norm_backward", grad, x, w, b, 1e-5)
    assert_matches(run("layer_norm_backward", grad, x, w, b, 1e-5), expected, dtype, scale=10)


def test_layer_norm_centres_each_row_twice() -> None:
    """Like the C++ kernel and the reference, the kernels centre x as (x - shift) - offset: a
    constant row of 88.7 gives the bias exactly and no weight gradient (the first fp32 mean's
    rounding, normalised, made it the bias plus 2.4e-3), and rows at 300 + 0.05 randn match
    float64 ``F.layer_norm`` forward and backward (the forward was 3e-3 off)."""
    g = torch.Generator().manual_seed(5)
    constant = torch.full((2, 64), 88.7)
    w, b, grad = randn(g, 64, dtype=torch.float32), randn(g, 64, dtype=torch.float32), constant
    assert torch.equal(run("layer_norm", constant, w, b, 1e-5), b.expand(2, 64))
    _, dw, _ = run("layer_norm_backward", grad, constant, w, b, 1e-5)
    assert torch.equal(dw, torch.zeros(64))

    x = randn(g, 64, 1000, dtype=torch.float32, scale=0.05) + 300.0
    w, b = randn(g, 1000, dtype=torch.float32), randn(g, 1000, dtype=torch.float32)
    grad = randn(g, 64, 1000, dtype=torch.float32)
    exact_args = [t.double().requires_grad_() for t in (x, w, b)]
    exact = torch.nn.functional.layer_norm(exact_args[0], (1000,), *exact_args[1:], 1e-5)
    exact.backward(grad.double())
    out = run("layer_norm", x, w, b, 1e-5)
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=1e-5)
    for got, want in zip(run("layer_norm_backward", grad, x, w, b, 1e-5), exact_args, strict=True):
        scale = float(want.grad.abs().max())
        torch.testing.assert_close(got.double(), want.grad, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("value", "cols"), [(3e38, 16), (-3e38, 2), (2.0**127, 4096), (-(2.0**120), 4096)]
)
def test_layer_norm_of_a_row_whose_sum_overflows_is_finite(value, cols, dtype) -> None:
    """The first mean scales each term by 1 / cols, as the C++ kernel does: a constant row
    whose sum is beyond float32 gives the bias and no weight gradient, as the C++ kernel (the
    sum overflowed to inf, and every output was NaN). The values are such that the scaled sum
    rounds to them exactly in the interpreter's summation order too."""
    g = torch.Generator().manual_seed(11)
    x = torch.full((2, cols), value).to(dtype)
    w, b, grad = (
        randn(g, cols, dtype=dtype),
        randn(g, cols, dtype=dtype),
        randn(g, 2, cols, dtype=dtype),
    )
    out = run("layer_norm", x, w, b, 1e-5)
    assert torch.equal(out, b.expand(2, cols))
    assert torch.equal(out, torch.ops.spore.layer_norm(x, w, b, 1e-5))  # the C++ kernel
    dx, dw, db = run("layer_norm_backward", grad, x, w, b, 1e-5)
    assert dx.isfinite().all()
    assert torch.equal(dw, torch.zeros(cols, dtype=dtype))
    assert torch.equal(db, grad.float().sum(0).to(dtype))


@pytest.mark.parametrize("dim", [1, 0])
def test_mean_var_centres_twice(dim) -> None:
    """The mean is the first fp32 mean plus the mean deviation from it: a constant 1e20 gives
    that mean, a variance of 0 and gradients of exactly grad_mean / n (over dim 0 the first
    mean's rounding made them 2.6e13, 7e26 and 1.5e12 off), and values at 300 + 0.05 randn
    match float64 (the mean was 1.6e-7 off, relative)."""
    g = torch.Generator().manual_seed(8)
    constant = torch.full((37, 37), 1e20)
    mean, var = run("mean_var", constant, dim, 1)
    assert torch.equal(mean, torch.full((37,), 1e20))
    assert torch.equal(var, torch.zeros(37))
    ones = torch.ones(37)
    dx = run("mean_var_backward", ones, ones, constant, dim, 1)
    assert torch.equal(dx, torch.full((37, 37), 1 / 37))

    x = randn(g, 1000, 64, dtype=torch.float32, scale=0.05) + 300.0
    x = x if dim == 0 else x.t().contiguous()
    gm, gv = randn(g, 64, dtype=torch.float32), randn(g, 64, dtype=torch.float32)
    exact_mean, exact_var = reference("mean_var", x.double(), dim, 1)
    mean, var = run("mean_var", x, dim, 1)
    torch.testing.assert_close(mean.double(), exact_mean, rtol=6e-8, atol=0)  # one rounding
    torch.testing.assert_close(var.double(), exact_var, rtol=1e-5, atol=0)
    exact = reference("mean_var_backward", gm.double(), gv.double(), x.double(), dim, 1)
    dx = run("mean_var_backward", gm, gv, x, dim, 1)
    torch.testing.assert_close(dx.double(), exact, rtol=0, atol=1e-6 * float(exact.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize(
    ("value", "n"), [(1.5 * 2.0**127, 16), (-3e38, 2), (2.0**127, 4096), (-(2.0**120), 4096)]
)
def test_mean_var_of_values_whose_sum_overflows_is_finite(value, n, dim, dtype) -> None:
    """The first mean scales each term by 1 / n: a constant column whose sum is beyond float32
    has that value as its mean, a variance of 0 and gradients of grad_mean / n, as the C++
    kernel (the sum overflowed to inf, and the mean, the variance and dx were NaN). The values
    are such that every partial sum of the scaled terms is exact (the interpreter adds
    them one at a time over dim 0, where 16 terms of 3e38 / 16 round: a shift one ulp off, whose
    square overflows)."""
    x = torch.full((n, 3) if dim == 0 else (3, n), value).to(dtype)
    mean, var = run("mean_var", x, dim, 1)
    assert torch.equal(mean, torch.full((3,), value).to(dtype))
    assert torch.equal(var, torch.zeros(3, dtype=dtype))
    assert torch.equal(mean, torch.ops.spore.mean_var(x, dim, 1)[0])  # the C++ kernel
    ones = torch.ones(3, dtype=dtype)
    dx = run("mean_var_backward", ones, ones, x, dim, 1)
    assert torch.equal(dx, torch.full_like(x, 1 / n))


MEAN_VAR_CASES = [
    ((5, 7), -1),
    ((5, 7), 0),
    ((3, 5, 6), 1),
    ((2, 300, 3), 1),
    ((3, _common.MAX_BLOCK + 3), 1),
    ((4, 200), 0),
    ((7,), 0),
    ((2, 0, 3), 1),
    ((1, 4), 0),
]


@pytest.mark.parametrize("correction", [0, 1, 2])
@pytest.mark.filterwarnings("ignore:var_mean... degrees of freedom is <= 0:UserWarning")
@ieee
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "dim"), MEAN_VAR_CASES, ids=str)
def test_mean_var(shape, dim, dtype, correction) -> None:
    """Including an empty dimension (NaN) and n - correction <= 0 (inf or NaN, like torch)."""
    g = torch.Generator().manual_seed(sum(shape) + dim)
    x = randn(g, *shape, dtype=dtype, scale=2) + 3
    expected = reference("mean_var", x, dim, correction)
    mean, var = run("mean_var", x, dim, correction)
    assert_matches((mean, var), expected, dtype)
    unused = torch.zeros_like(var)  # the variance's gradient where it goes unused: adds nothing
    for grad_mean, grad_var in [
        (mean, var),
        (None, var),
        (mean, None),
        (None, None),
        (mean, unused),
    ]:
        args = (grad_mean, grad_var, x, dim, correction)
        expected = reference("mean_var_backward", *args)
        assert_matches(run("mean_var_backward", *args), expected, dtype, scale=10)


@ieee
@FAST
@given(
    shape=st.sampled_from([(0, 3), (1,), (7, 5), (3, 1031), (2, 3, 40)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
    approximate=st.sampled_from(["none", "tanh"]),
)
def test_gelu_and_backward(shape, dtype, seed, approximate) -> None:
    g = torch.Generator().manual_seed(seed)
    x, grad = randn(g, *shape, dtype=dtype, scale=4), randn(g, *shape, dtype=dtype)
    assert_matches(run("gelu", x, approximate), reference("gelu", x, approximate), dtype)
    expected = reference("gelu_backward", grad, x, approximate)
    assert_matches(run("gelu_backward", grad, x, approximate), expected, dtype)


@ieee
def test_gelu_saturates_without_overflow() -> None:
    x = torch.tensor([-1e30, -100.0, -10.0, 0.0, 10.0, 100.0, 1e30])
    for approximate in ("none", "tanh"):
        out = run("gelu", x, approximate)
        assert torch.isfinite(out).all()
        assert_matches(out, reference("gelu", x, approximate), torch.float32)


def test_exact_gelu_keeps_its_relative_accuracy_in_the_left_tail() -> None:
    """0.5 x (1 + erf(x / sqrt 2)) cancelled to -0 below x = -5.9 (the reference and the C++
    kernel give -5.92e-9 at -6), and its backward's Phi(x) likewise."""
    x = -torch.linspace(0.0, 12.0, 2401)  # gelu(-12) ~ 2e-32: normal in fp32
    grad = torch.ones_like(x)
    want = reference("gelu", x.double(), "none")
    got = run("gelu", x, "none").double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)  # x^2 / 2 rounds: s eps
    x, grad = x[x <= -2], grad[x <= -2]  # Phi(x) + x phi(x) crosses 0 at x = -0.75
    want = reference("gelu_backward", grad.double(), x.double(), "none")
    got = run("gelu_backward", grad, x, "none").double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@ieee
@pytest.mark.parametrize("scale", [1e-14, 1e-20])
def test_rms_norm_backward_of_rows_near_zero_with_eps_zero_stays_finite(scale) -> None:
    """x ~ 1e-14, eps = 0: rstd ~ 1e14, whose cube overflowed fp32 (dx inf/NaN where the C++
    kernel and the float64 reference are finite)."""
    g = torch.Generator().manual_seed(8)
    x, w = randn(g, 3, 64, dtype=torch.float32, scale=scale), randn(g, 64, dtype=torch.float32)
    grad = randn(g, 3, 64, dtype=torch.float32)
    dx, _ = run("rms_norm_backward", grad, x, w, 0.0)
    want, _ = reference("rms_norm_backward", grad.double(), x.double(), w.double(), 0.0)
    torch.testing.assert_close(dx.double(), want, rtol=1e-4, atol=0)


@FAST
@given(
    shape=st.sampled_from([(0, 4), (1, 2), (7, 10), (3, 2062), (2, 3, 40)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_silu_mul_swiglu_and_backward(shape, dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    a, b = randn(g, *shape, dtype=dtype, scale=3), randn(g, *shape, dtype=dtype)
    grad = randn(g, *shape, dtype=dtype)
    assert_matches(run("silu_mul", a, b), reference("silu_mul", a, b), dtype)
    expected = reference("silu_mul_backward", grad, a, b)
    assert_matches(run("silu_mul_backward", grad, a, b), expected, dtype)
    assert_matches(run("swiglu", a), reference("swiglu", a), dtype)
    half_grad = grad[..., : shape[-1] // 2].contiguous()
    expected = reference("swiglu_backward", half_grad, a)
    assert_matches(run("swiglu_backward", half_grad, a), expected, dtype)


# x's shape and its cos/sin table's (D = x's last dimension; a table of D/2 is one angle a pair).
ROPE_LAYOUTS = [
    ((2, 5, 3, 8), (5, 1, 8)),  # [B, S, H, D] with [S, 1, D]
    ((2, 3, 5, 8), (2, 1, 5, 8)),  # [B, H, S, D] with [B, 1, S, D]
    ((2, 3, 5, 8), (5, 8)),  # [B, H, S, D] with [S, D]
    ((2, 3, 5, 8), (5, 4)),  # half tables
    ((4, 6), (4, 3)),
    ((3, 2), (1, 2)),
    ((0, 4), (1, 4)),
    ((1, 2, 1, 3, 2 * _common.MAX_BLOCK + 6), (2, 1, 1, 2 * _common.MAX_BLOCK + 6)),
]


@pytest.mark.parametrize("mode", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("x_shape", "table_shape"), ROPE_LAYOUTS, ids=str)
def test_rope_and_backward(x_shape, table_shape, dtype, mode) -> None:
    g = torch.Generator().manual_seed(sum(x_shape))
    x, grad = randn(g, *x_shape, dtype=dtype), randn(g, *x_shape, dtype=dtype)
    angles = torch.rand(*table_shape, generator=g) * 6
    for tables in [(angles.cos().to(dtype), angles.sin().to(dtype)), (angles.cos(), angles.sin())]:
        assert_matches(run("rope", x, *tables, mode), reference("rope", x, *tables, mode), dtype)
        expected = reference("rope_backward", grad, *tables, mode)
        assert_matches(run("rope_backward", grad, *tables, mode), expected, dtype)


@ieee
@FAST
@given(
    shape=st.tuples(
        st.sampled_from([(), (2,)]),  # batch dims
        st.integers(1, 3),  # I
        st.sampled_from([1, 5, 33]),  # J (33: two query blocks)
        st.sampled_from([1, 6, 40]),  # K (40: two key blocks)
        st.integers(1, 2),  # H
        st.sampled_from([4, 16, 33]),  # D
    ),
    with_bias=st.booleans(),
    masked=st.sampled_from([None, 0.3, 0.9]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_triangle_attention_and_backward(shape, with_bias, masked, dtype, seed) -> None:
    """Against the reference, forward and every gradient; masks that leave rows with no key."""
    batch, i, j, keys, h, d = shape
    g = torch.Generator().manual_seed(seed)
    q = randn(g, *batch, i, j, h, d, dtype=dtype)
    k, v = (randn(g, *batch, i, keys, h, d, dtype=dtype) for _ in range(2))
    bias = randn(g, *batch, h, j, keys, dtype=dtype) if with_bias else None
    mask = torch.rand(*batch, i, keys, generator=g) >= masked if masked is not None else None
    _triangle_attention_matches(g, (q, k, v, bias, mask), dtype)


def _triangle_attention_matches(g: torch.Generator, args: tuple, dtype: torch.dtype) -> None:
    """The kernels' forward and every gradient on ``(q, k, v, bias, mask)`` against the
    reference's."""
    out = run("triangle_attention", *args, None)
    assert_matches(out, reference("triangle_attention", *args, None), dtype)
    grad = randn(g, *out.shape, dtype=dtype)
    bwd = (grad, *args, out, None)
    expected = reference("triangle_attention_backward", *bwd)
    assert_matches(run("triangle_attention_backward", *bwd), expected, dtype, scale=10)


@ieee
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triangle_attention_with_rows_masked_by_their_bias(dtype) -> None:
    """A row whose bias is finfo.min at every key, a key with a bias of 3e38: bias * log2 e
    overflowed to an inf, and the row came out zeros (the reference: the mean of v). A row
    whose bias is -1e9 at every key (an OpenFold-style mask): its gradients were off by the
    row's sum, log2 of which was lost beside the max in the saved log-sum-exp."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (randn(g, 2, 5, 2, 8, dtype=dtype) for _ in range(3))
    bias = randn(g, 2, 5, 5, dtype=dtype)
    bias[:, 1] = torch.finfo(dtype).min
    bias[:, 4] = -1e9
    bias[0, 3, 2] = 3e38
    _triangle_attention_matches(g, (q, k, v, bias, None), dtype)


def test_triangle_attention_bf16_backward_at_three_keys_and_one_dim() -> None:
    """K = 3 keys, D = 1 in bf16 against a float64 reference, within 2e-2 of each gradient's
    scale: delta taken from the saved bf16 output put dq 2.5 % off."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 13, 2, 1, generator=g)
    k = torch.randn(3, 3, 2, 1, generator=g) * 1.5
    v = torch.randn(3, 3, 2, 1, generator=g)
    args = tuple(t.bfloat16() for t in (q, k, v))
    wide = tuple(t.double() for t in args)
    out = run("triangle_attention", *args, None, None, None)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    got = run("triangle_attention_backward", grad, *args, None, None, out, None)
    expected = reference("triangle_attention", *wide, None, None, None)
    want = reference(
        "triangle_attention_backward", grad.double(), *wide, None, None, expected, None
    )
    for a, w in zip(got[:3], want[:3], strict=True):
        tol = 2e-2 * max(float(w.abs().max()), 1.0)
        torch.testing.assert_close(a.double(), w, rtol=2e-2, atol=tol)


@ieee
def test_triangle_attention_keeps_garbage_at_masked_keys_out() -> None:
    """inf or NaN in a masked key's k, v or bias (padding holding garbage): the kernels read k
    and v at every key inside the sequence, and 0 * inf (or NaN) in P v, dP = dO v^T and
    dq = dS k made rows and gradients NaN. The results are the reference's on clean padding;
    40 keys span two key blocks, the masked ones in both."""
    g = torch.Generator().manual_seed(5)
    q = randn(g, 1, 2, 5, 2, 8, dtype=torch.float32)
    k, v = (randn(g, 1, 2, 40, 2, 8, dtype=torch.float32) for _ in range(2))
    bias = randn(g, 1, 2, 5, 40, dtype=torch.float32)
    mask = torch.ones(1, 2, 40, dtype=torch.bool)
    mask[..., [3, 35]] = False
    clean = [t.clone() for t in (k, v)]
    for t in clean:
        t[:, :, [3, 35]] = 0
    clean.append(bias.clone())
    clean[2][..., [3, 35]] = 0
    k[0, :, 3] = v[0, :, 35] = bias[..., 35] = float("nan")
    v[0, :, 3] = float("inf")
    want = reference("triangle_attention", q, *clean, mask, None)
    out = run("triangle_attention", q, k, v, bias, mask, None)
    assert bool(out.isfinite().all())
    assert_matches(out, want, torch.float32)
    grad = randn(g, *out.shape, dtype=torch.float32)
    expected = reference("triangle_attention_backward", grad, q, *clean, mask, want, None)
    got = run("triangle_attention_backward", grad, q, k, v, bias, mask, out, None)
    assert_matches(got, expected, torch.float32, scale=10)


def test_triangle_attention_rows_with_no_key_are_zero() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (randn(g, 2, 3, 4, 2, 8, dtype=torch.float32) for _ in range(3))
    bias = randn(g, 2, 2, 4, 4, dtype=torch.float32)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[1, 2] = False  # batch 1, row i = 2: no key
    out = run("triangle_attention", q, k, v, bias, mask, 0.5)
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2]))
    grads = run("triangle_attention_backward", torch.ones_like(out), q, k, v, bias, mask, out, 0.5)
    for grad in grads[:3]:
        assert torch.equal(grad[1, 2], torch.zeros_like(grad[1, 2]))
    expected = reference(
        "triangle_attention_backward", torch.ones_like(out), q, k, v, bias, mask, out, 0.5
    )
    assert_matches(grads, expected, torch.float32, scale=10)


def _refused() -> list[tuple[str, tuple[Any, ...]]]:
    x, w = torch.randn(4, 8), torch.randn(8)
    return [
        ("rms_norm", (x.t(), torch.randn(4), 1e-6)),
        ("rms_norm", (x, w.half(), 1e-6)),
        ("rms_norm", (x.double(), w.double(), 1e-6)),
        ("rms_norm", (x, torch.randn(5), 1e-6)),
        ("rms_norm", (x[:, :0], w[:0], 1e-6)),
        ("rms_norm_backward", (x.t().contiguous().t(), x, w, 1e-6)),
        ("add_rms_norm", (x, x[:1], w, 1e-6)),
        ("add_rms_norm_backward", (x, x[:1], x, w, 1e-6)),
        ("layer_norm", (x, None, torch.randn(3), 1e-5)),
        ("layer_norm_backward", (x[:1], x, w, None, 1e-5)),
        ("layer_norm_backward", (x, x, None, w.half(), 1e-5)),
        ("mean_var", (x, 2, 1)),
        ("mean_var", (x, 0, -1)),
        ("mean_var", (torch.tensor(1.0), 0, 1)),
        ("mean_var", (torch.randn(1, 128 * 65536), 0, 1)),
        ("mean_var_backward", (torch.randn(4), None, x, 0, 1)),
        ("mean_var_backward", (None, torch.randn(4).half(), x, 1, 1)),
        ("gelu", (x, "sigmoid")),
        ("gelu", (x.to(torch.int32), "none")),
        ("gelu_backward", (x[:1], x, "none")),
        ("silu_mul", (x, x[:1])),
        ("silu_mul_backward", (x, x, x[:1])),
        ("swiglu", (torch.randn(4, 7),)),
        ("swiglu", (torch.randn(4, 0),)),
        ("swiglu_backward", (x, x)),
        ("rope", (x, x.cos(), x.sin(), "neox")),
        ("rope", (torch.randn(4, 7), torch.randn(4, 7), torch.randn(4, 7), "half")),
        ("rope", (x, torch.randn(4, 5), torch.randn(4, 5), "half")),
        ("rope", (x, torch.randn(3, 8), torch.randn(3, 8), "half")),
        ("rope", (x, torch.randn(4, 8), torch.randn(4, 4), "half")),
        ("rope", (x.half(), torch.randn(4, 8).double(), torch.randn(4, 8).double(), "half")),
        ("rope", (x.half(), torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16(), "half")),
        (
            "rope",
            (
                torch.randn(2, 3, 4, 5, 8),
                torch.randn(2, 1, 4, 1, 8),
                torch.randn(2, 1, 4, 1, 8),
                "half",
            ),
        ),
        ("rope_backward", (x.t(), torch.randn(8, 4), torch.randn(8, 4), "half")),
        ("triangle_attention", (*[torch.randn(1, 2, 2, 1, 4).double()] * 3, None, None, None)),
        ("triangle_attention", (*[torch.randn(1, 2, 2, 1, 300)] * 3, None, None, None)),
        (
            "triangle_attention",
            (*[torch.randn(1, 2, 2, 1, 4)] * 3, torch.randn(1, 2, 2), None, None),
        ),
        ("triangle_attention", (*[torch.randn(1, 2, 0, 1, 4)] * 3, None, None, None)),
        (
            "triangle_attention_backward",
            (*[torch.randn(1, 2, 2, 1, 4)] * 4, None, None, torch.randn(1, 2, 2, 1, 3), None),
        ),
    ]


@pytest.mark.parametrize(("op", "args"), _refused(), ids=lambda v: v if isinstance(v, str) else "")
def test_what_a_kernel_cannot_take_is_refused(op, args) -> None:
    assert not cuda.kernels()[op][1](*args)


def _schema_names(schema: str) -> list[str]:
    arguments = schema[schema.index("(") + 1 : schema.index(") ->")]
    return [part.split()[-1].split("=")[0] for part in arguments.split(",")]


def test_every_kernel_matches_its_op_schema() -> None:
    for op, (launcher, supports) in cuda.kernels().items():
        names = _schema_names(dispatch.get(op).schema)
        assert list(inspect.signature(launcher).parameters) == names, op
        assert list(inspect.signature(supports).parameters) == names, op


def test_registration_follows_the_device() -> None:
    """Registered (by the plugin, at load) exactly when a CUDA device is present."""
    for op in cuda.kernels():
        providers = [k.provider for k in dispatch.get(op).candidates("cuda")]
        assert providers == (["kernels"] if CUDA else []), op


class Recorder:
    """An OpRegistry stand-in that records ``kernel`` calls instead of touching dispatch."""

    def __init__(self) -> None:
        self.kernels: dict[str, tuple[Any, ...]] = {}

    def kernel(self, op: str, device: str, fn: Any, *, priority: int, supports: Any) -> None:
        self.kernels[op] = (device, fn, priority, supports)


def test_plugin_registers_every_kernel_when_cuda_is_there(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    recorder = Recorder()
    assert registration.register_cuda(recorder) is True
    assert recorder.kernels == {
        op: ("cuda", fn, _checks.PRIORITY, supports)
        for op, (fn, supports) in cuda.kernels().items()
    }


def test_plugin_skips_cuda_without_a_device_or_without_triton(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert registration.register_cuda(recorder := Recorder()) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert registration.register_cuda(recorder) is False
    assert recorder.kernels == {}


def test_plugin_survives_a_failing_registration(monkeypatch, caplog) -> None:
    def broken(registry: Any) -> None:
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "register", broken)
    assert registration.register_cuda(Recorder()) is False
    assert "CUDA kernels not registered: RuntimeError: no kernel image" in caplog.text


BACKWARD_ROWS = {"MASK": "*u8", "LSE": "*fp32", "LOGL": "*fp32", "DELTA": "*fp32"}
"""The mask and per-row statistics every triangle_attention backward kernel reads."""

# Each kernel's argument types for an ahead-of-time compile ("T": the dtype under test).
COMPILE = {
    "rms_norm._rms_norm_fwd": (
        {"X": "*T", "W": "*T", "Y": "*T", "cols": "i32", "eps": "fp32"},
        {},
    ),
    "add_rms_norm._add_rms_norm_fwd": (
        {"X": "*T", "R": "*T", "W": "*T", "Y": "*T", "S": "*T", "cols": "i32", "eps": "fp32"},
        {},
    ),
    "rms_norm._rms_norm_bwd_dx": (
        {"G": "*T", "GS": "*T", "X": "*T", "W": "*T", "DX": "*T", "RSTD": "*fp32"}
        | {"cols": "i32", "eps": "fp32"},
        {"HAS_GS": True},
    ),
    "layer_norm._layer_norm_fwd": (
        {"X": "*T", "W": "*T", "B": "*T", "Y": "*T", "cols": "i32", "eps": "fp32"},
        {"HAS_W": True, "HAS_B": True},
    ),
    "layer_norm._layer_norm_bwd_dx": (
        {"G": "*T", "X": "*T", "W": "*T", "DX": "*T"}
        | {"SHIFT": "*fp32", "OFFSET": "*fp32", "RSTD": "*fp32", "cols": "i32", "eps": "fp32"},
        {"HAS_W": True},
    ),
    "_param_grads._param_grads": (
        {"G": "*T", "X": "*T", "SHIFT": "*fp32", "OFFSET": "*fp32", "RSTD": "*fp32"}
        | {"DW": "*fp32", "DB": "*fp32", "rows": "i32", "cols": "i32", "rows_per_group": "i32"},
        {"CENTRED": True, "HAS_DW": True, "HAS_DB": True, "BM": 32, "BN": 64},
    ),
    "mean_var._mean_var": (
        {"X": "*T", "MEAN": "*T", "VAR": "*T", "n": "i32", "inner": "i32", "divisor": "fp32"},
        {"BN": 16, "BI": 128},
    ),
    "mean_var._mean_var_bwd": (
        {"GM": "*T", "GV": "*T", "X": "*T", "DX": "*T", "n": "i32", "inner": "i32"}
        | {"scale": "fp32"},
        {"HAS_GM": True, "HAS_GV": True, "BN": 16, "BI": 128},
    ),
    "gelu._gelu_fwd": ({"X": "*T", "Y": "*T", "n": "i32"}, {"TANH": True}),
    "gelu._gelu_bwd": ({"G": "*T", "X": "*T", "DX": "*T", "n": "i32"}, {"TANH": False}),
    "glu._silu_mul_fwd": ({"A": "*T", "B": "*T", "Y": "*T", "n": "i32"}, {}),
    "glu._silu_mul_bwd": (
        {"G": "*T", "A": "*T", "B": "*T", "DA": "*T", "DB": "*T", "n": "i32"},
        {},
    ),
    "glu._swiglu_fwd": ({"X": "*T", "Y": "*T", "half": "i32"}, {}),
    "glu._swiglu_bwd": ({"G": "*T", "X": "*T", "DX": "*T", "half": "i32"}, {}),
    "rope._rope": (
        {"X": "*T", "COS": "*fp32", "SIN": "*fp32", "Y": "*T"}
        | {p: "i32" for p in ("mid", "inner", "step_o", "step_m", "step_i", "dim", "table_cols")},
        {"INTERLEAVED": True, "HALF_TABLE": True, "TRANSPOSE": True},
    ),
    "triangle_attention._tri_attn_fwd": (
        {p: "*T" for p in ("Q", "K", "V", "BIAS", "OUT")}
        | {"MASK": "*u8", "LSE": "*fp32", "LOGL": "*fp32", "scale2": "fp32"}
        | {p: "i32" for p in ("ni", "nj", "nk", "heads", "dim")},
        {"HAS_BIAS": True, "HAS_MASK": True, "STORE_LSE": True, "BM": 32, "BN": 32, "BD": 32},
    ),
    "triangle_attention._tri_attn_bwd_dkdv": (
        {p: "*T" for p in ("Q", "K", "V", "BIAS", "G", "DK", "DV")}
        | BACKWARD_ROWS
        | {"scale": "fp32", "scale2": "fp32"}
        | {p: "i32" for p in ("ni", "nj", "nk", "heads", "dim")},
        {"HAS_BIAS": True, "HAS_MASK": True, "BM": 32, "BN": 32, "BD": 32},
    ),
    "triangle_attention._tri_attn_bwd_dq": (
        {p: "*T" for p in ("Q", "K", "V", "BIAS", "G", "DQ")}
        | BACKWARD_ROWS
        | {"scale": "fp32", "scale2": "fp32"}
        | {p: "i32" for p in ("ni", "nj", "nk", "heads", "dim")},
        {"HAS_BIAS": True, "HAS_MASK": True, "BM": 32, "BN": 32, "BD": 32},
    ),
    "triangle_attention._tri_attn_bwd_dbias": (
        {p: "*T" for p in ("Q", "K", "V", "BIAS", "G", "DBIAS")}
        | BACKWARD_ROWS
        | {"scale2": "fp32"}
        | {p: "i32" for p in ("ni", "nj", "nk", "heads", "dim")},
        {"HAS_MASK": True, "BM": 32, "BN": 32, "BD": 32},
    ),
}
FP32_OUT = {"_param_grads._param_grads"}  # kernels that store only fp32 partial sums
HELPERS = {
    "gelu._half_erfc",
    "layer_norm._row_mean",
    "layer_norm._rstd",
    "mean_var._column_mean",
    "triangle_attention._logits",
    "triangle_attention._probs",
    "triangle_attention._read_keys",
}  # jitted functions compiled inside the kernels that call them
TRITON_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


_COMPILER = """
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

table, dtypes = json.loads(sys.argv[1])
found = {}
for kernel, (types, constexprs) in table.items():
    module, name = kernel.split(".")
    fn = getattr(importlib.import_module("spore_kernels.cuda." + module), name)
    constexprs = constexprs | ({"BLOCK": 1024} if "BLOCK" in fn.arg_names else {})
    flipped = {k: not v if isinstance(v, bool) else v for k, v in constexprs.items()}
    variants = [constexprs] + ([flipped] if flipped != constexprs else [])
    for dtype in dtypes:
        found[kernel + ":" + dtype] = results = []
        for flags in variants:
            signature = {
                p: "constexpr" if p in flags else types[p].replace("T", dtype)
                for p in fn.arg_names
            }
            source = ASTSource(fn=fn, signature=signature, constexprs=flags)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
            converts = sorted(set(re.findall(r"cvt\\.[a-z0-9.]+", compiled.asm["ptx"])))
            results.append({"cubin": len(compiled.asm["cubin"]), "cvt": converts})
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Any]:
    """Every kernel in ``COMPILE`` compiled for sm_90 by a fresh process (no interpreter there;
    an empty compile cache), per dtype, with its flags as given and all flipped: the cubin size
    and the PTX conversions of each."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    spec = json.dumps([COMPILE, list(TRITON_DTYPE.values())])
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER, spec], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_compile_table_covers_every_kernel() -> None:
    found = set()
    for info in pkgutil.iter_modules(cuda.__path__):
        module = importlib.import_module(f"spore_kernels.cuda.{info.name}")
        found |= {
            f"{info.name}.{name}"
            for name, value in vars(module).items()
            if hasattr(value, "fn") and hasattr(value, "arg_names")
        }
    assert found == set(COMPILE) | HELPERS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", sorted(COMPILE))
def test_kernels_compile_for_sm90(compiled, kernel, dtype) -> None:
    """A cubin for an H100-class GPU for each flag setting; with the flags as given, outputs
    narrower than fp32 round to nearest even (``cvt.rn``; flipped, a kernel may store only
    constant zeros); nothing rounds toward zero."""
    narrow = {torch.bfloat16: "cvt.rn.bf16.f32", torch.float16: "cvt.rn.f16.f32"}
    results = compiled[f"{kernel}:{TRITON_DTYPE[dtype]}"]
    flags = [v for v in COMPILE[kernel][1].values() if isinstance(v, bool)]
    assert len(results) == (2 if flags else 1)
    assert all(result["cubin"] > 0 for result in results)
    if dtype in narrow and kernel not in FP32_OUT:  # one value at a time, or two packed
        packed = narrow[dtype].replace(".f32", "x2.f32")
        assert {narrow[dtype], packed} & set(results[0]["cvt"])
    assert not [c for result in results for c in result["cvt"] if c.startswith("cvt.rz")]
