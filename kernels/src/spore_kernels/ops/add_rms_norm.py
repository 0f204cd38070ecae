"""``add_rms_norm(x, residual, weight, eps) -> (y, s)`` and its backward.

Numerics contract: ``s = x + residual`` rounded to x's dtype (exactly torch's ``x + residual``;
it is the residual stream the next layer uses), and ``y`` is computed from that rounded ``s``
with rms_norm's contract (float32, normalise and multiply by the weight, rounded once), so
``y == torch.ops.spore.rms_norm(s, weight, eps)`` where the C++ kernel runs: one pass per row
writes ``s`` and rms_norm's own row routine normalises it, so that equality holds by
construction. The reference (inputs the kernel does not take, e.g. a non-contiguous ``x``)
computes the same formula with torch's ops, equal within fp32 rounding.
Backward: ``add_rms_norm_backward(grad, grad_sum, sum, weight, eps) -> (dsum, dweight)`` with
``dsum`` = the rms_norm gradient at ``s`` plus ``grad_sum`` (float32, rounded once); it is the
gradient of both x and residual. Forward saves ``s`` and the weight.
"""

from __future__ import annotations

from typing import Any

import torch

from spore_kernels import _checks, _lib
from spore_kernels.ops import rms_norm

SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor? grad_sum, Tensor sum, Tensor weight, float eps) -> (Tensor, Tensor)"
)


def check(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """Clear errors for the inputs add_rms_norm cannot take."""
    _checks.floating("add_rms_norm", x=x, residual=residual, weight=weight)
    if residual.dtype != x.dtype:
        raise TypeError(
            f"add_rms_norm: residual must have x's dtype {x.dtype}, got {residual.dtype}; "
            f"cast one of them"
        )
    if residual.shape != x.shape:
        raise ValueError(
            f"add_rms_norm: residual must have x's shape {tuple(x.shape)}, "
            f"got {tuple(residual.shape)}"
        )
    if x.dim() < 1:
        raise ValueError("add_rms_norm needs x with at least one dimension")
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"add_rms_norm weight must have shape {tuple(x.shape[-1:])} (x's last dimension), "
            f"got {tuple(weight.shape)}"
        )
    _checks.same_device("add_rms_norm", x=x, residual=residual, weight=weight)


def reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check(x, residual, weight)
    _checks.epsilon("add_rms_norm", eps)
    s = x + residual
    return rms_norm.reference(s, weight, eps), s


def _check_backward(
    grad: torch.Tensor, grad_sum: torch.Tensor | None, s: torch.Tensor, weight: torch.Tensor
) -> None:
    """rms_norm's errors for the sum and weight, and the grads of the sum's shape and floats."""
    rms_norm.check(s, weight)
    _checks.upstream("add_rms_norm_backward", s.shape, grad=grad, grad_sum=grad_sum)


def reference_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm's gradients at ``s`` (:func:`rms_norm.gradients`), plus grad_sum to ds before
    its one rounding; ds contiguous."""
    _check_backward(grad, grad_sum, s, weight)
    _checks.epsilon("add_rms_norm_backward", eps)
    ds, dw = rms_norm.gradients(grad, s, weight, eps)
    if grad_sum is not None:
        ds = ds + grad_sum.to(ds.dtype)
    return ds.to(s.dtype).contiguous(), dw.to(weight.dtype)


def supports(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """Contiguous CPU tensors of one kernel dtype, residual shaped like x, weight like its rows,
    a valid eps."""
    return (
        _checks.ready(x, residual, weight, device_type="cpu")
        and _checks.valid_eps(eps)
        and x.dim() >= 1
        and residual.shape == x.shape
        and weight.shape == x.shape[-1:]
        and x.shape[-1] > 0
    )


def supports_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> bool:
    upstream = [grad] if grad_sum is None else [grad, grad_sum]
    return (
        _checks.ready(s, weight, *upstream, device_type="cpu")
        and _checks.valid_eps(eps)
        and s.dim() >= 1
        and weight.shape == s.shape[-1:]
        and s.shape[-1] > 0
        and all(g.shape == s.shape for g in upstream)
    )


_FWD = (*(_lib.ptr,) * 5, _lib.i64, _lib.i64, _lib.f32, _lib.i32, _lib.i32)
_BWD = (*(_lib.ptr,) * 6, _lib.i64, _lib.i64, _lib.f32, _lib.i32, _lib.i32)


def _cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = torch.empty_like(x), torch.empty_like(x)
    if x.numel() == 0:
        return y, s
    rows, cols = _checks.rows_cols(x)
    ptrs = (x.data_ptr(), residual.data_ptr(), weight.data_ptr(), y.data_ptr(), s.data_ptr())
    args = (*ptrs, rows, cols, float(eps), _lib.dtype_code(x), _lib.threads())
    _lib.call("spore_add_rms_norm", _FWD, *args)
    return y, s


def _cpu_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    ds = torch.empty_like(s)
    if s.numel() == 0:
        return ds, torch.zeros_like(weight)
    dw = torch.empty_like(weight)
    rows, cols = _checks.rows_cols(s)
    gs = None if grad_sum is None else grad_sum.data_ptr()
    ptrs = (grad.data_ptr(), gs, s.data_ptr(), weight.data_ptr(), ds.data_ptr(), dw.data_ptr())
    args = (*ptrs, rows, cols, float(eps), _lib.dtype_code(s), _lib.threads())
    _lib.call("spore_add_rms_norm_backward", _BWD, *args)
    return ds, dw


def _fake_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    s: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_backward(grad, grad_sum, s, weight)
    _checks.epsilon("add_rms_norm_backward", eps)
    return torch.empty_like(s, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, _, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps


def _backward(ctx: Any, grad: torch.Tensor | None, grad_sum: torch.Tensor | None) -> tuple:
    s, weight = ctx.saved_tensors
    grad = torch.zeros_like(s) if grad is None else grad.contiguous()
    grad_sum = None if grad_sum is None else grad_sum.contiguous()
    ds, dw = torch.ops.spore.add_rms_norm_backward(grad, grad_sum, s, weight, ctx.eps)
    return ds, ds, dw, None


cpu = _checks.direct("add_rms_norm", _cpu, supports)


cpu_backward = _checks.direct("add_rms_norm_backward", _cpu_backward, supports_backward)


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define(
        "add_rms_norm_backward", BACKWARD_SCHEMA, reference=reference_backward, fake=_fake_backward
    )
    registry.kernel(
        bwd, "cpu", _cpu_backward, priority=_checks.PRIORITY, supports=supports_backward
    )
    fwd = registry.define(
        "add_rms_norm",
        SCHEMA,
        reference=reference,
        backward=_backward,
        setup_context=_setup_context,
    )
    registry.kernel(fwd, "cpu", _cpu, priority=_checks.PRIORITY, supports=supports)


EPS = rms_norm.EPS


def composite(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a user writes: the residual add, then the float32 RMSNorm composite."""
    s = x + residual
    return rms_norm.composite(s, weight, eps), s


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    def make(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8192, 4096, generator=g).to(dtype)
        residual = torch.randn(8192, 4096, generator=g).to(dtype)
        return x, residual, torch.randn(4096, generator=g).to(dtype)

    return [
        OpBench(
            op="add_rms_norm",
            shape="8192x4096",
            make=make,
            spore=lambda x, r, w: torch.ops.spore.add_rms_norm(x, r, w, EPS),
            baselines={"eager": ("eager composite (x + residual, then rms_norm)", composite)},
            differentiable=(0, 1, 2),
        )
    ]
