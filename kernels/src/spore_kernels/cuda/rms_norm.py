"""rms_norm over the last dimension, forward and backward (the backward, :func:`backward`, also
serves add_rms_norm). One program per row; rows longer than a block loop over column chunks
(the row is re-read from cache). Statistics in fp32, one rounding per output, as the
references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.cuda import _common
from spore_kernels.cuda._param_grads import param_grads


@triton.jit
def _rms_norm_fwd(X, W, Y, cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(X + row + offs, mask=offs < cols, other=0.0).to(tl.float32)
        acc += x * x
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / cols + eps)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_dx(G, GS, X, W, DX, RSTD, cols, eps, HAS_GS: tl.constexpr, BLOCK: tl.constexpr):
    # dx = rstd * (g*w - x*k), k = rstd * (rstd * mean(g*w*x)) (+ gs, the gradient of
    # add_rms_norm's sum): never rstd^3, which overflows for tiny rows (rstd ~ 1e14 at eps 0)
    # where dx is finite, as the C++ kernel; rstd is kept for the dweight kernel.
    r = tl.program_id(0).to(tl.int64)
    row = r * cols
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    dot = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        sq += x * x
        dot += g * w * x
    rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / cols + eps)
    k = rstd * (rstd * (tl.sum(dot, axis=0) / cols))
    tl.store(RSTD + r, rstd)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        dx = rstd * (g * w - x * k)
        if HAS_GS:
            dx += tl.load(GS + row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row + offs, dx.to(DX.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    _common.row_launch(_rms_norm_fwd, x, x, weight, y, eps=float(eps))
    return y


def backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx row by row (saving rstd), then dweight from the column sums; ``grad_sum`` (add_rms_norm's
    gradient of its sum output, if any) is added to dx before its rounding."""
    rows, _ = _checks.rows_cols(x)
    dx = torch.empty_like(x)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    gs = grad if grad_sum is None else grad_sum  # an unread placeholder pointer when absent
    args = (grad, gs, x, weight, dx, rstd)
    _common.row_launch(_rms_norm_bwd_dx, x, *args, eps=float(eps), HAS_GS=grad_sum is not None)
    dw, _ = param_grads(grad, x, None, rstd, weight, None)
    return dx, dw


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(grad, None, x, weight, eps)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    return _common.row_params(x, weight) and _checks.valid_eps(eps)


def supports_rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    return supports_rms_norm(x, weight, eps) and _checks.ready(grad, x) and grad.shape == x.shape


KERNELS = {
    "rms_norm": (rms_norm, supports_rms_norm),
    "rms_norm_backward": (rms_norm_backward, supports_rms_norm_backward),
}
