"""mean_var over one dimension: x viewed as [outer, n, inner], one program per (outer index,
block of inner columns) looping over n. Two passes in fp32 (the mean, then the squared deviations
from it), each output rounded once; the divisor is max(n - correction, 0) as in torch."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from spore_kernels.cuda import _common

TILE = 2048  # elements one program loads per step
MAX_INNER_BLOCK = 128
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


@triton.jit
def _mean_var(X, MEAN, VAR, n, inner, divisor, BN: tl.constexpr, BI: tl.constexpr):
    o = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    col_mask = cols < inner
    base = X + o * n * inner
    acc = tl.zeros([BN, BI], dtype=tl.float32)
    for start in range(0, n, BN):
        rows = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rows < n)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows[:, None] * inner + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
    mean = tl.sum(acc, axis=0) / n
    acc = tl.zeros([BN, BI], dtype=tl.float32)
    for start in range(0, n, BN):
        rows = (start + tl.arange(0, BN)).to(tl.int64)
        mask = (rows < n)[:, None] & col_mask[None, :]
        x = tl.load(base + rows[:, None] * inner + cols[None, :], mask=mask, other=0.0)
        d = tl.where(mask, x.to(tl.float32) - mean[None, :], 0.0)
        acc += d * d
    var = tl.sum(acc, axis=0) / divisor
    out = o * inner + cols
    tl.store(MEAN + out, mean.to(MEAN.dtype.element_ty), mask=col_mask)
    tl.store(VAR + out, var.to(VAR.dtype.element_ty), mask=col_mask)


def _split(x: torch.Tensor, dim: int) -> tuple[int, int, int, list[int]]:
    d = dim % x.dim()
    shape = list(x.shape)
    return math.prod(shape[:d]), shape[d], math.prod(shape[d + 1 :]), shape[:d] + shape[d + 1 :]


def mean_var(x: torch.Tensor, dim: int, correction: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    outer, n, inner, shape = _split(x, dim)
    mean, var = x.new_empty(shape), x.new_empty(shape)
    if outer * inner == 0:
        return mean, var
    bi = min(triton.next_power_of_2(inner), MAX_INNER_BLOCK)
    bn = min(triton.next_power_of_2(max(n, 1)), TILE // bi)
    divisor = float(max(n - correction, 0))
    _mean_var[(outer, triton.cdiv(inner, bi))](
        x, mean, var, n, inner, divisor, BN=bn, BI=bi, num_warps=_common.warps(bn * bi)
    )
    return mean, var


def supports_mean_var(x: torch.Tensor, dim: int, correction: int = 1) -> bool:
    """x of a kernel dtype with at least one dimension, a valid dim, correction >= 0, and few
    enough inner column blocks for the grid."""
    if not (_common.ready(x) and x.dim() >= 1 and -x.dim() <= dim < x.dim() and correction >= 0):
        return False
    inner = _split(x, dim)[2]
    return triton.cdiv(inner, MAX_INNER_BLOCK) <= MAX_GRID_Y


KERNELS = {"mean_var": (mean_var, supports_mean_var)}
