"""add_rms_norm over the last dimension, forward and backward: the forward writes the rounded
sum and normalises it, the backward is rms_norm's (:func:`spore_kernels.cuda.rms_norm.backward`)
at that sum plus the gradient of the sum. One program per row, as rms_norm."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.cuda import _common, rms_norm


@triton.jit
def _add_rms_norm_fwd(X, R, W, Y, S, cols, eps, BLOCK: tl.constexpr):
    # s = round(x + r) is an output; the norm is of that rounded s (recomputed in the second
    # pass rather than read back from S).
    row = tl.program_id(0).to(tl.int64) * cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + row + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row + offs, s, mask=mask)
        sf = s.to(tl.float32)
        acc += sf * sf
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / cols + eps)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + row + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row + offs, (s * rstd * w).to(Y.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = torch.empty_like(x), torch.empty_like(x)
    _common.row_launch(_add_rms_norm_fwd, x, x, residual, weight, y, s, eps=float(eps))
    return y, s


def add_rms_norm_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    sum: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum`` is add_rms_norm's output s (the schema's name)."""
    return rms_norm.backward(grad, grad_sum, sum, weight, eps)


def supports_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    return (
        _common.row_params(x, weight)
        and _checks.valid_eps(eps)
        and _checks.ready(x, residual)
        and residual.shape == x.shape
    )


def supports_add_rms_norm_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    sum: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> bool:
    upstream = [grad] if grad_sum is None else [grad, grad_sum]
    return (
        _common.row_params(sum, weight)
        and _checks.valid_eps(eps)
        and _checks.ready(sum, *upstream)
        and all(g.shape == sum.shape for g in upstream)
    )


KERNELS = {
    "add_rms_norm": (add_rms_norm, supports_add_rms_norm),
    "add_rms_norm_backward": (add_rms_norm_backward, supports_add_rms_norm_backward),
}
