"""mean_var over one dimension, forward and backward: x viewed as [outer, n, inner], one program
per (outer index, block of inner columns) looping over n. x is centred twice, as the reference
does: a first fp32 mean (the shift), then the mean of d = x - shift (the offset), x - mean being
(x - shift) - offset, so that the first mean's rounding does not reach every x - mean. Forward:
two passes in fp32 (the shift, then the sums of d and of d * d; the mean is shift + offset, the
variance the sum of (d - offset)^2, computed as the sum of d * d less offset times the sum of d),
each output rounded once; the divisor is max(n - correction, 0) as in torch. Backward:
dx = grad_mean / n + grad_var * 2 (x - mean) / (n - correction) with the shift and offset
recomputed in fp32 (one pass over x each; a zero grad_var adding nothing), as the reference."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.cuda import _common

TILE = 2048  # elements one program loads per step
MAX_INNER_BLOCK = 128


@triton.jit
def _column_mean(X, n, inner, cols, col_mask, BN: tl.constexpr, BI: tl.constexpr):
    """The sum of x / n down each of the columns ``cols`` of X viewed as [n, inner]: each term
    scaled, as in the C++ kernel, so that values near float32's largest do not overflow to inf
    (a sum divided once did)."""
    scale = 1.0 / n
    acc = tl.zeros([BN, BI], dtype=tl.float32)
    for start in range(0, n, BN):
        rows = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rows < n)[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * inner + cols[None, :], mask=mask, other=0.0)
        acc += x.to(tl.float32) * scale
    return tl.sum(acc, axis=0)


@triton.jit
def _mean_var(X, MEAN, VAR, n, inner, divisor, BN: tl.constexpr, BI: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    col_mask = cols < inner
    base = X + o * n * inner
    shift = _column_mean(base, n, inner, cols, col_mask, BN, BI)
    sum_d = tl.zeros([BN, BI], dtype=tl.float32)
    sum_dd = tl.zeros([BN, BI], dtype=tl.float32)
    for start in range(0, n, BN):
        rows = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rows < n)[:, None] & col_mask[None, :]
        x = tl.load(base + rows[:, None] * inner + cols[None, :], mask=mask, other=0.0)
        d = tl.where(mask, x.to(tl.float32) - shift[None, :], 0.0)
        sum_d += d
        sum_dd += d * d
    total_d = tl.sum(sum_d, axis=0)
    offset = total_d / n
    mean = shift + offset
    m2 = tl.maximum(
        tl.sum(sum_dd, axis=0) - offset * total_d, 0.0, propagate_nan=tl.PropagateNan.ALL
    )
    var = m2 / divisor
    out = o * inner + cols
    tl.store(MEAN + out, mean.to(MEAN.dtype.element_ty), mask=col_mask)
    tl.store(VAR + out, var.to(VAR.dtype.element_ty), mask=col_mask)


@triton.jit
def _mean_var_bwd(
    GM,
    GV,
    X,
    DX,
    n,
    inner,
    scale,
    HAS_GM: tl.constexpr,
    HAS_GV: tl.constexpr,
    BN: tl.constexpr,
    BI: tl.constexpr,
):
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    col_mask = cols < inner
    base = o * n * inner
    out = o * inner + cols
    if HAS_GM:
        gm_n = tl.load(GM + out, mask=col_mask, other=0.0).to(tl.float32) / n
    if HAS_GV:
        gv = tl.load(GV + out, mask=col_mask, other=0.0).to(tl.float32)
        gv_scaled = tl.where(gv == 0.0, 0.0, gv * scale)  # n == correction: 0 * inf is not NaN
        shift = _column_mean(X + base, n, inner, cols, col_mask, BN, BI)
        acc = tl.zeros([BN, BI], dtype=tl.float32)
        for start in range(0, n, BN):
            rows = (start + tl.arange(0, BN)).to(tl.int64)
            mask = (rows < n)[:, None] & col_mask[None, :]
            at = base + rows[:, None] * inner + cols[None, :]
            x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
            acc += tl.where(mask, x - shift[None, :], 0.0)
        offset = tl.sum(acc, axis=0) / n
    for start in range(0, n, BN):
        rows = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rows < n)[:, None] & col_mask[None, :]
        at = base + rows[:, None] * inner + cols[None, :]
        dx = tl.zeros([BN, BI], dtype=tl.float32)
        if HAS_GM:
            dx += gm_n[None, :]
        if HAS_GV:
            x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
            dx += gv_scaled[None, :] * ((x - shift[None, :]) - offset[None, :])
        tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)


def _split(x: torch.Tensor, dim: int) -> tuple[int, int, int, list[int]]:
    d = dim % x.dim()
    shape = list(x.shape)
    return math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :]), shape[:d] + shape[d + 1 :]


def _blocks(n: int, inner: int) -> tuple[int, int]:
    bi = min(triton.next_power_of_2(inner), MAX_INNER_BLOCK)
    return min(triton.next_power_of_2(max(n, 1)), TILE // bi), bi


def mean_var(x: torch.Tensor, dim: int, correction: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    outer, n, inner, shape = _split(x, dim)
    mean, var = x.new_empty(shape), x.new_empty(shape)
    if outer * inner == 0:
        return mean, var
    bn, bi = _blocks(n, inner)
    divisor = float(max(n - correction, 0))
    _mean_var[(outer, triton.cdiv(inner, bi))](
        x, mean, var, n, inner, divisor, BN=bn, BI=bi, num_warps=_common.warps(bn * bi)
    )
    return mean, var


def mean_var_backward(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> torch.Tensor:
    outer, n, inner, _ = _split(x, dim)
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx
    dof = n - correction
    scale = 2.0 / dof if dof else math.inf
    bn, bi = _blocks(n, inner)
    gm = x if grad_mean is None else grad_mean  # unread placeholder pointers when absent
    gv = x if grad_var is None else grad_var
    flags = {"HAS_GM": grad_mean is not None, "HAS_GV": grad_var is not None}
    _mean_var_bwd[(outer, triton.cdiv(inner, bi))](
        gm, gv, x, dx, n, inner, scale, **flags, BN=bn, BI=bi, num_warps=_common.warps(bn * bi)
    )
    return dx


def supports_mean_var(x: torch.Tensor, dim: int, correction: int = 1) -> bool:
    """x of a kernel dtype with at least one dimension, a valid dim, correction >= 0, and few
    enough inner column blocks for the grid."""
    if not (_checks.ready(x) and x.dim() >= 1 and -x.dim() <= dim < x.dim() and correction >= 0):
        return False
    inner = _split(x, dim)[2]
    return triton.cdiv(inner, MAX_INNER_BLOCK) <= _common.MAX_GRID_Y


def supports_mean_var_backward(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> bool:
    if not supports_mean_var(x, dim, correction):
        return False
    upstream = [g for g in (grad_mean, grad_var) if g is not None]
    shape = _split(x, dim)[3]
    return _checks.ready(x, *upstream) and all(list(g.shape) == shape for g in upstream)


KERNELS = {
    "mean_var": (mean_var, supports_mean_var),
    "mean_var_backward": (mean_var_backward, supports_mean_var_backward),
}
