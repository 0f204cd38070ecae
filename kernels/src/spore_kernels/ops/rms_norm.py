"""``rms_norm(x, weight, eps)`` and its backward.

Numerics contract: computed in float32 whatever the input dtype (float64 stays float64) —
normalise, multiply by the weight in float32 — and rounded once to x's dtype. This is the
Gemma-style cast order; Hugging Face Llama rounds the normalised x to the input dtype before
multiplying by the weight, which differs by up to one rounding step in bf16/fp16.
Backward: ``rms_norm_backward(grad, x, weight, eps) -> (dx, dweight)``, fp32 accumulation,
rstd recomputed from x (forward saves only its inputs).
"""

from __future__ import annotations

from typing import Any

import torch

from spore_kernels import _checks, _lib

SCHEMA = "(Tensor x, Tensor weight, float eps) -> Tensor"
BACKWARD_SCHEMA = "(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)"


def check(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Clear errors for the inputs rms_norm cannot take."""
    _checks.floating("rms_norm", x=x, weight=weight)
    if x.dim() < 1:
        raise ValueError("rms_norm needs x with at least one dimension")
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm weight must have shape {tuple(x.shape[-1:])} (x's last dimension), "
            f"got {tuple(weight.shape)}"
        )
    _checks.same_device("rms_norm", x=x, weight=weight)


def check_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The forward's errors for x and weight, and grad of the output's shape and a float."""
    check(x, weight)
    _checks.upstream("rms_norm_backward", x.shape, grad=grad)


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check(x, weight)
    _checks.epsilon("rms_norm", eps)
    xf = x.to(_checks.compute_dtype(x))
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    return out.to(x.dtype)


def gradients(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The closed form, unrounded (in x's compute dtype): dx = rstd * (g*w - xhat *
    mean(g*w*xhat)) and dw = the sum over rows of g*xhat, with xhat = x * rstd."""
    compute = _checks.compute_dtype(x)
    xf, gf, wf = x.to(compute), grad.to(compute), weight.to(compute)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    gw = gf * wf
    dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = _checks.column_sums(gf * xhat)
    return dx, dw


def reference_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gradients`, each rounded once; dx contiguous (as the kernel's and the fake's)."""
    check_backward(grad, x, weight)
    _checks.epsilon("rms_norm_backward", eps)
    dx, dw = gradients(grad, x, weight, eps)
    return dx.to(x.dtype).contiguous(), dw.to(weight.dtype)


def supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """Contiguous CPU x and weight of one kernel dtype, weight matching x's last dimension,
    a valid eps."""
    return (
        _checks.ready(x, weight, device_type="cpu")
        and _checks.valid_eps(eps)
        and x.dim() >= 1
        and weight.shape == x.shape[-1:]
        and x.shape[-1] > 0
    )


def supports_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    return (
        supports(x, weight, eps)
        and _checks.ready(grad, x, device_type="cpu")
        and grad.shape == x.shape
    )


_FWD = (_lib.ptr, _lib.ptr, _lib.ptr, _lib.i64, _lib.i64, _lib.f32, _lib.i32, _lib.i32)
_BWD = (*(_lib.ptr,) * 5, _lib.i64, _lib.i64, _lib.f32, _lib.i32, _lib.i32)


def _cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel() == 0:  # an empty batch: nothing to compute (and no buffer to pass)
        return y
    rows, cols = _checks.rows_cols(x)
    args = (x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, cols, float(eps))
    _lib.call("spore_rms_norm", _FWD, *args, _lib.dtype_code(x), _lib.threads())
    return y


def _cpu_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros_like(weight)
    dw = torch.empty_like(weight)
    rows, cols = _checks.rows_cols(x)
    ptrs = (grad.data_ptr(), x.data_ptr(), weight.data_ptr(), dx.data_ptr(), dw.data_ptr())
    args = (*ptrs, rows, cols, float(eps), _lib.dtype_code(x), _lib.threads())
    _lib.call("spore_rms_norm_backward", _BWD, *args)
    return dx, dw


def _fake_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_backward(grad, x, weight)
    _checks.epsilon("rms_norm_backward", eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, weight = ctx.saved_tensors
    dx, dw = torch.ops.spore.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps)
    return dx, dw, None


cpu = _checks.direct("rms_norm", _cpu, supports)


cpu_backward = _checks.direct("rms_norm_backward", _cpu_backward, supports_backward)


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define(
        "rms_norm_backward", BACKWARD_SCHEMA, reference=reference_backward, fake=_fake_backward
    )
    registry.kernel(
        bwd, "cpu", _cpu_backward, priority=_checks.PRIORITY, supports=supports_backward
    )
    fwd = registry.define(
        "rms_norm", SCHEMA, reference=reference, backward=_backward, setup_context=_setup_context
    )
    registry.kernel(fwd, "cpu", _cpu, priority=_checks.PRIORITY, supports=supports)


EPS = 1e-6


def composite(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """The RMSNorm a user writes (Hugging Face style, computed in float32)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    def make(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8192, 4096, generator=g).to(dtype), torch.randn(4096, generator=g).to(
            dtype
        )

    return [
        OpBench(
            op="rms_norm",
            shape="8192x4096",
            make=make,
            spore=lambda x, w: torch.ops.spore.rms_norm(x, w, EPS),
            baselines={
                "eager": ("eager composite", composite),
                "F.rms_norm": (
                    "torch.nn.functional.rms_norm",
                    lambda x, w: torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS),
                ),
            },
            differentiable=(0, 1),
        )
    ]
