"""layer_norm over the last dimension, forward and backward, with optional weight and bias.
One program per row; two-pass fp32 statistics (a first mean, the shift; then the deviations
d = x - shift, their mean, the offset, and their mean square, less the offset's square: the
biased variance); x centred twice, as (x - shift) - offset, like the C++ kernel and the
reference, so that the first mean's rounding does not reach every x - mean; one rounding per
output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.cuda import _common
from spore_kernels.cuda._param_grads import param_grads


@triton.jit
def _row_mean(X, row, cols, BLOCK: tl.constexpr):
    """The sum of x / cols over a row: each term scaled, as in the C++ kernel, so that a row
    near float32's largest values does not overflow to inf (a sum divided once did)."""
    scale = 1.0 / cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + row + offs, mask=offs < cols, other=0.0).to(tl.float32) * scale
    return tl.sum(acc, axis=0)


@triton.jit
def _rstd(sum_d, sum_dd, cols, eps):
    """(offset, rstd) from the sums of d = x - shift and of d * d over a row: the variance is
    the mean of d * d less the offset's square (small against the spread, shift being a mean
    already), at least 0."""
    offset = sum_d / cols
    var = tl.maximum(sum_dd / cols - offset * offset, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return offset, tl.math.rsqrt(var + eps)


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, cols, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * cols
    shift = _row_mean(X, row, cols, BLOCK)
    sum_d = tl.zeros([BLOCK], dtype=tl.float32)
    sum_dd = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift, 0.0)
        sum_d += d
        sum_dd += d * d
    offset, rstd = _rstd(tl.sum(sum_d, axis=0), tl.sum(sum_dd, axis=0), cols, eps)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        y = ((x - shift) - offset) * rstd
        if HAS_W:
            y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_dx(
    G, X, W, DX, SHIFT, OFFSET, RSTD, cols, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr
):
    # dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), gw = g * w,
    # xhat = ((x - shift) - offset) * rstd; shift, offset and rstd are kept for the weight/bias
    # kernel.
    r = tl.program_id(0).to(tl.int64)
    row = r * cols
    shift = _row_mean(X, row, cols, BLOCK)
    sum_d = tl.zeros([BLOCK], dtype=tl.float32)
    sum_dd = tl.zeros([BLOCK], dtype=tl.float32)
    sum_gw = tl.zeros([BLOCK], dtype=tl.float32)
    sum_gwd = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift, 0.0)
        gw = tl.load(G + row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            gw = gw * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        sum_d += d
        sum_dd += d * d
        sum_gw += gw
        sum_gwd += gw * d
    offset, rstd = _rstd(tl.sum(sum_d, axis=0), tl.sum(sum_dd, axis=0), cols, eps)
    total_gw = tl.sum(sum_gw, axis=0)
    mean_gw = total_gw / cols
    # the sum of gw * (d - offset) is the sum of gw * d less offset times the sum of gw
    mean_gwx = rstd * (tl.sum(sum_gwd, axis=0) - offset * total_gw) / cols
    tl.store(SHIFT + r, shift)
    tl.store(OFFSET + r, offset)
    tl.store(RSTD + r, rstd)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = ((x - shift) - offset) * rstd
        gw = tl.load(G + row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            gw = gw * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        dx = rstd * (gw - mean_gw - xhat * mean_gwx)
        tl.store(DX + row + offs, dx.to(DX.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    y = torch.empty_like(x)
    w = x if weight is None else weight  # unread placeholder pointers when absent
    b = x if bias is None else bias
    flags = {"HAS_W": weight is not None, "HAS_B": bias is not None}
    _common.row_launch(_layer_norm_fwd, x, x, w, b, y, eps=float(eps), **flags)
    return y


def layer_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dx row by row (saving shift, offset and rstd), then dweight and dbias from the column
    sums."""
    rows, _ = _checks.rows_cols(x)
    dx = torch.empty_like(x)
    shift, offset, rstd = torch.empty(3, rows, dtype=torch.float32, device=x.device)
    w = x if weight is None else weight
    args = (grad, x, w, dx, shift, offset, rstd)
    _common.row_launch(_layer_norm_bwd_dx, x, *args, eps=float(eps), HAS_W=weight is not None)
    if weight is None and bias is None:
        return dx, None, None
    dw, db = param_grads(grad, x, (shift, offset), rstd, weight, bias)
    return dx, dw, db


def supports_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> bool:
    return _common.row_params(x, weight, bias) and _checks.valid_eps(eps)


def supports_layer_norm_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> bool:
    return (
        supports_layer_norm(x, weight, bias, eps)
        and _checks.ready(grad, x)
        and grad.shape == x.shape
    )


KERNELS = {
    "layer_norm": (layer_norm, supports_layer_norm),
    "layer_norm_backward": (layer_norm_backward, supports_layer_norm_backward),
}
