"""Gated SiLU: ``silu_mul(a, b) = silu(a) * b`` and ``swiglu(x) = silu_mul(x1, x2)`` with
``x1, x2`` the two halves of x's last dimension, and their backward ops.

Numerics contract: computed in float32 whatever the input dtype (float64 stays float64) and
rounded once to the input dtype; the kernel writes ``sigmoid(a)`` as ``num / (1 + exp(-|a|))``
(no overflow, no cancellation): its float32 silu is within 3.7 ulp of float64 for a > -87 (every
float32 up to 100 checked; the worst, 3.68 ulp, at a = -3.2411; torch's F.silu: 2.4); below,
exp(a) is subnormal and so is the precision of the result (< 1e-35).
``b`` broadcasts to ``a``; the kernel takes equal shapes and anything else runs the reference
(which sums ``db`` back to b's shape). Backward: ``da = g b s (1 + a (1 - s))`` and
``db = g a s`` with ``s = sigmoid(a)``, one fused pass: ``silu_mul_backward(grad, a, b) ->
(da, db)`` and ``swiglu_backward(grad, x) -> dx``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from spore_kernels import _checks, _lib

SILU_MUL_SCHEMA = "(Tensor a, Tensor b) -> Tensor"
SILU_MUL_BACKWARD_SCHEMA = "(Tensor grad, Tensor a, Tensor b) -> (Tensor, Tensor)"
SWIGLU_SCHEMA = "(Tensor x) -> Tensor"
SWIGLU_BACKWARD_SCHEMA = "(Tensor grad, Tensor x) -> Tensor"


def check_silu_mul(a: torch.Tensor, b: torch.Tensor) -> None:
    """Clear errors for the inputs silu_mul cannot take."""
    _checks.floating("silu_mul", a=a, b=b)
    if a.dtype != b.dtype:
        raise TypeError(
            f"silu_mul: a is {a.dtype} but b is {b.dtype}; cast one so both have one dtype"
        )
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        shape = None
    if shape != a.shape:
        raise ValueError(
            f"silu_mul: b of shape {tuple(b.shape)} must broadcast to a's shape {tuple(a.shape)}"
        )
    _checks.same_device("silu_mul", a=a, b=b)


def check_swiglu(x: torch.Tensor) -> None:
    """Clear errors for the inputs swiglu cannot take."""
    _checks.floating("swiglu", x=x)
    if x.dim() < 1 or x.shape[-1] % 2:
        size = x.shape[-1] if x.dim() else "none (a 0-dim tensor)"
        raise ValueError(
            f"swiglu splits x's last dimension into two halves, so it must be even; got {size}"
        )


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def reference_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    check_silu_mul(a, b)
    compute = _checks.compute_dtype(a)
    return (F.silu(a.to(compute)) * b.to(compute)).to(a.dtype)


def reference_silu_mul_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed form: da = g b s (1 + a (1 - s)), db = g a s summed to b's shape."""
    check_silu_mul(a, b)
    _checks.upstream("silu_mul_backward", a.shape, grad=grad)
    compute = _checks.compute_dtype(a)
    af, bf, gf = a.to(compute), b.to(compute), grad.to(compute)
    s = torch.sigmoid(af)
    da = gf * bf * s * (1 + af * (1 - s))
    db = (gf * af * s).sum_to_size(b.shape)
    return da.to(a.dtype), db.to(b.dtype)


def reference_swiglu(x: torch.Tensor) -> torch.Tensor:
    check_swiglu(x)
    a, b = _halves(x.to(_checks.compute_dtype(x)))
    return (F.silu(a) * b).to(x.dtype)


def reference_swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """silu_mul's closed form on the two halves, concatenated."""
    check_swiglu(x)
    _checks.upstream("swiglu_backward", (*x.shape[:-1], x.shape[-1] // 2), grad=grad)
    da, db = reference_silu_mul_backward(grad, *_halves(x))
    return torch.cat([da, db], dim=-1)


def supports_silu_mul(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Contiguous CPU a and b of one kernel dtype and one shape."""
    return a.shape == b.shape and _checks.ready(a, b, device_type="cpu")


def supports_silu_mul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return grad.shape == a.shape == b.shape and _checks.ready(grad, a, b, device_type="cpu")


def supports_swiglu(x: torch.Tensor) -> bool:
    """Contiguous CPU x of a kernel dtype with an even, non-zero last dimension."""
    return (
        x.dim() >= 1
        and x.shape[-1] > 0
        and x.shape[-1] % 2 == 0
        and _checks.ready(x, device_type="cpu")
    )


def supports_swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        supports_swiglu(x)
        and grad.shape == (*x.shape[:-1], x.shape[-1] // 2)
        and _checks.ready(grad, x, device_type="cpu")
    )


_SILU_MUL = (_lib.ptr, _lib.ptr, _lib.ptr, _lib.i64, _lib.i32, _lib.i32)
_SILU_MUL_BWD = (*(_lib.ptr,) * 5, _lib.i64, _lib.i32, _lib.i32)
_SWIGLU = (_lib.ptr, _lib.ptr, _lib.i64, _lib.i64, _lib.i32, _lib.i32)
_SWIGLU_BWD = (_lib.ptr, _lib.ptr, _lib.ptr, _lib.i64, _lib.i64, _lib.i32, _lib.i32)


def _cpu_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(a)
    if a.numel():
        args = (a.data_ptr(), b.data_ptr(), y.data_ptr(), a.numel())
        _lib.call("spore_silu_mul", _SILU_MUL, *args, _lib.dtype_code(a), _lib.threads())
    return y


def _cpu_silu_mul_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    da, db = torch.empty_like(a), torch.empty_like(b)
    if a.numel():
        ptrs = (grad.data_ptr(), a.data_ptr(), b.data_ptr(), da.data_ptr(), db.data_ptr())
        args = (*ptrs, a.numel(), _lib.dtype_code(a), _lib.threads())
        _lib.call("spore_silu_mul_backward", _SILU_MUL_BWD, *args)
    return da, db


def _cpu_swiglu(x: torch.Tensor) -> torch.Tensor:
    rows, cols = _checks.rows_cols(x)
    y = x.new_empty((*x.shape[:-1], cols // 2))
    if rows:
        args = (x.data_ptr(), y.data_ptr(), rows, cols // 2, _lib.dtype_code(x), _lib.threads())
        _lib.call("spore_swiglu", _SWIGLU, *args)
    return y


def _cpu_swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(x)
    rows, cols = _checks.rows_cols(x)
    if rows:
        ptrs = (grad.data_ptr(), x.data_ptr(), dx.data_ptr())
        args = (*ptrs, rows, cols // 2, _lib.dtype_code(x), _lib.threads())
        _lib.call("spore_swiglu_backward", _SWIGLU_BWD, *args)
    return dx


def _setup_silu_mul(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward_silu_mul(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    a, b = ctx.saved_tensors
    return torch.ops.spore.silu_mul_backward(grad.contiguous(), a, b)


def _setup_swiglu(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward_swiglu(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return torch.ops.spore.swiglu_backward(grad.contiguous(), x)


cpu_silu_mul = _checks.direct("silu_mul", _cpu_silu_mul, supports_silu_mul)


cpu_silu_mul_backward = _checks.direct(
    "silu_mul_backward", _cpu_silu_mul_backward, supports_silu_mul_backward
)


cpu_swiglu = _checks.direct("swiglu", _cpu_swiglu, supports_swiglu)


cpu_swiglu_backward = _checks.direct(
    "swiglu_backward", _cpu_swiglu_backward, supports_swiglu_backward
)


def register(registry: Any) -> None:
    """Define silu_mul and swiglu (each with its backward op) and their CPU kernels."""
    bwd = registry.define(
        "silu_mul_backward", SILU_MUL_BACKWARD_SCHEMA, reference=reference_silu_mul_backward
    )
    registry.kernel(
        bwd,
        "cpu",
        _cpu_silu_mul_backward,
        priority=_checks.PRIORITY,
        supports=supports_silu_mul_backward,
    )
    fwd = registry.define(
        "silu_mul",
        SILU_MUL_SCHEMA,
        reference=reference_silu_mul,
        backward=_backward_silu_mul,
        setup_context=_setup_silu_mul,
    )
    registry.kernel(
        fwd, "cpu", _cpu_silu_mul, priority=_checks.PRIORITY, supports=supports_silu_mul
    )
    bwd = registry.define(
        "swiglu_backward", SWIGLU_BACKWARD_SCHEMA, reference=reference_swiglu_backward
    )
    registry.kernel(
        bwd,
        "cpu",
        _cpu_swiglu_backward,
        priority=_checks.PRIORITY,
        supports=supports_swiglu_backward,
    )
    fwd = registry.define(
        "swiglu",
        SWIGLU_SCHEMA,
        reference=reference_swiglu,
        backward=_backward_swiglu,
        setup_context=_setup_swiglu,
    )
    registry.kernel(fwd, "cpu", _cpu_swiglu, priority=_checks.PRIORITY, supports=supports_swiglu)


def composite_silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a user writes: F.silu(a) * b."""
    return F.silu(a) * b


def composite_swiglu(x: torch.Tensor) -> torch.Tensor:
    """What a user writes: chunk, then F.silu(a) * b."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    def make_pair(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        a = (torch.randn(8192, 4096, generator=g) * 2).to(dtype)
        return a, torch.randn(8192, 4096, generator=g).to(dtype)

    def make_fused(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor]:
        return ((torch.randn(8192, 8192, generator=g) * 2).to(dtype),)

    return [
        OpBench(
            op="silu_mul",
            shape="8192x4096 (a, b, out)",
            make=make_pair,
            spore=lambda a, b: torch.ops.spore.silu_mul(a, b),
            baselines={"eager": ("eager F.silu(a) * b", composite_silu_mul)},
            differentiable=(0, 1),
        ),
        OpBench(
            op="swiglu",
            shape="8192x8192 -> 8192x4096",
            make=make_fused,
            spore=lambda x: torch.ops.spore.swiglu(x),
            baselines={"eager": ("eager chunk, F.silu(a) * b", composite_swiglu)},
        ),
    ]
