"""Row norms over the last dimension: rms_norm (forward and backward), add_rms_norm and
layer_norm. One program per row; rows longer than a block loop over column chunks (the row is
re-read from cache). Statistics in fp32, one rounding per output, as the references."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from spore_kernels.cuda import _common


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
    # dx = rstd * g*w - x * rstd^3 * mean(g*w*x) (+ gs, the gradient of add_rms_norm's sum);
    # rstd is kept for the dweight kernel.
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
    coef = rstd * rstd * rstd * tl.sum(dot, axis=0) / cols
    tl.store(RSTD + r, rstd)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        dx = rstd * g * w - x * coef
        if HAS_GS:
            dx += tl.load(GS + row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_dw(
    G, X, RSTD, PARTIAL, rows, cols, rows_per_group, BM: tl.constexpr, BN: tl.constexpr
):
    # Program (column block, row group): the sum over the group's rows of g * x * rstd.
    cb = tl.program_id(0)
    group = tl.program_id(1).to(tl.int64)
    cols_offs = cb * BN + tl.arange(0, BN)
    col_mask = cols_offs < cols
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, rows)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for start in range(first, last, BM):
        rws = start + tl.arange(0, BM)
        row_mask = rws < last
        mask = row_mask[:, None] & col_mask[None, :]
        at = rws[:, None] * cols + cols_offs[None, :]
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rws, mask=row_mask, other=0.0)
        acc += g * x * rstd[:, None]
    tl.store(PARTIAL + group * cols + cols_offs, tl.sum(acc, axis=0), mask=col_mask)


@triton.jit
def _add_rms_norm_fwd(X, R, W, Y, S, cols, eps, BLOCK: tl.constexpr):
    # s = round(x + r) is an output; the norm is of that rounded s.
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


@triton.jit
def _layer_norm_fwd(
    X, W, B, Y, cols, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr
):
    # Two-pass statistics: the mean, then the mean squared deviation from it.
    row = tl.program_id(0).to(tl.int64) * cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + row + offs, mask=offs < cols, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean, 0.0)
        acc += d * d
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / cols + eps)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        y = (tl.load(X + row + offs, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row + offs, y.to(Y.dtype.element_ty), mask=mask)


def _row_launch(kernel: Any, x: torch.Tensor, *args: Any, **constexprs: Any) -> None:
    rows, cols = _common.rows_cols(x)
    if rows == 0:
        return
    size = _common.block(cols)
    kernel[(rows,)](*args, cols, **constexprs, BLOCK=size, num_warps=_common.warps(size))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    _row_launch(_rms_norm_fwd, x, x, weight, y, eps=float(eps))
    return y


def _norm_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx row by row (saving rstd), then dweight as per-row-group fp32 partial sums added up."""
    rows, cols = _common.rows_cols(x)
    dx = torch.empty_like(x)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    gs = grad if grad_sum is None else grad_sum  # an unread placeholder pointer when absent
    args = (grad, gs, x, weight, dx, rstd)
    _row_launch(_rms_norm_bwd_dx, x, *args, eps=float(eps), HAS_GS=grad_sum is not None)
    bm, bn = 32, min(triton.next_power_of_2(cols), 64)
    per_group = triton.cdiv(triton.cdiv(rows, min(triton.cdiv(rows, bm), 128)), bm) * bm
    groups = triton.cdiv(rows, per_group)
    partial = torch.empty(groups, cols, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_dw[(triton.cdiv(cols, bn), groups)](
        grad, x, rstd, partial, rows, cols, per_group, BM=bm, BN=bn
    )
    return dx, partial.sum(0).to(weight.dtype)


def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_backward(grad, None, x, weight, eps)


def add_rms_norm_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    sum: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum`` is add_rms_norm's output s (the schema's name)."""
    return _norm_backward(grad, grad_sum, sum, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = torch.empty_like(x), torch.empty_like(x)
    _row_launch(_add_rms_norm_fwd, x, x, residual, weight, y, s, eps=float(eps))
    return y, s


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    y = torch.empty_like(x)
    w = x if weight is None else weight  # an unread placeholder pointer when absent
    b = x if bias is None else bias
    _row_launch(
        _layer_norm_fwd,
        x,
        x,
        w,
        b,
        y,
        eps=float(eps),
        HAS_W=weight is not None,
        HAS_B=bias is not None,
    )
    return y


def _row_params(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """x with at least one non-empty dimension; each given parameter of shape [x.shape[-1]]."""
    return (
        x.dim() >= 1
        and x.shape[-1] > 0
        and all(p is None or p.shape == x.shape[-1:] for p in params)
        and _common.ready(x, *[p for p in params if p is not None])
    )


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    return _row_params(x, weight)


def supports_rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    return _row_params(x, weight) and _common.ready(grad, x) and grad.shape == x.shape


def supports_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    return _row_params(x, weight) and _common.ready(x, residual) and residual.shape == x.shape


def supports_add_rms_norm_backward(
    grad: torch.Tensor,
    grad_sum: torch.Tensor | None,
    sum: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> bool:
    upstream = [grad] if grad_sum is None else [grad, grad_sum]
    return (
        _row_params(sum, weight)
        and _common.ready(sum, *upstream)
        and all(g.shape == sum.shape for g in upstream)
    )


def supports_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> bool:
    return _row_params(x, weight, bias)


KERNELS = {
    "rms_norm": (rms_norm, supports_rms_norm),
    "rms_norm_backward": (rms_norm_backward, supports_rms_norm_backward),
    "add_rms_norm": (add_rms_norm, supports_add_rms_norm),
    "add_rms_norm_backward": (add_rms_norm_backward, supports_add_rms_norm_backward),
    "layer_norm": (layer_norm, supports_layer_norm),
}
