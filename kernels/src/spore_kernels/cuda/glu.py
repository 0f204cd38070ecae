"""Gated SiLU, forward and backward: ``silu_mul(a, b) = silu(a) * b`` and ``swiglu(x)``, silu of
the first half of x's last dimension times the second. Elementwise in fp32, rounded once to the
input dtype; ``silu(a) = a / (1 + exp(-a))`` (exp overflowing to inf gives -0, the limit).
Backward: ``da = g b s (1 + a (1 - s))``, ``db = g a s`` with ``s = sigmoid(a)``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.cuda import _common

BLOCK = 1024


@triton.jit
def _silu_mul_fwd(A, B, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (a / (1.0 + tl.exp(-a)) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(G, A, B, DA, DB, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    tl.store(DA + offs, (g * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (g * a * s).to(DB.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_fwd(X, Y, half, BLOCK: tl.constexpr):
    # Program (row, column block): y = silu(x[:half]) * x[half:] within the row.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < half
    a = tl.load(X + row * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * 2 * half + half + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * half + offs, (a / (1.0 + tl.exp(-a)) * b).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(G, X, DX, half, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < half
    g = tl.load(G + row * half + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(X + row * 2 * half + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + row * 2 * half + half + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-a))
    da = g * b * s * (1.0 + a * (1.0 - s))
    tl.store(DX + row * 2 * half + offs, da.to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + row * 2 * half + half + offs, (g * a * s).to(DX.dtype.element_ty), mask=mask)


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(a)
    n = a.numel()
    if n:
        _silu_mul_fwd[(triton.cdiv(n, BLOCK),)](a, b, y, n, BLOCK=BLOCK)
    return y


def silu_mul_backward(
    grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        _silu_mul_bwd[(triton.cdiv(n, BLOCK),)](grad, a, b, da, db, n, BLOCK=BLOCK)
    return da, db


def _half_grid(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows, half, block) for x's last dimension split in two halves."""
    rows, cols = _checks.rows_cols(x)
    half = cols // 2
    return rows, half, min(triton.next_power_of_2(max(half, 1)), BLOCK)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    rows, half, size = _half_grid(x)
    y = x.new_empty((*x.shape[:-1], half))
    if rows and half:
        _swiglu_fwd[(rows, triton.cdiv(half, size))](x, y, half, BLOCK=size)
    return y


def swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    rows, half, size = _half_grid(x)
    dx = torch.empty_like(x)
    if rows and half:
        _swiglu_bwd[(rows, triton.cdiv(half, size))](grad, x, dx, half, BLOCK=size)
    return dx


def supports_silu_mul(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and _checks.ready(a, b)


def supports_silu_mul_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return grad.shape == a.shape == b.shape and _checks.ready(grad, a, b)


def supports_swiglu(x: torch.Tensor) -> bool:
    """An even, non-zero last dimension, with few enough column blocks for the grid."""
    return (
        x.dim() >= 1
        and x.shape[-1] > 0
        and x.shape[-1] % 2 == 0
        and triton.cdiv(x.shape[-1] // 2, BLOCK) <= _common.MAX_GRID_Y
        and _checks.ready(x)
    )


def supports_swiglu_backward(grad: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        supports_swiglu(x)
        and grad.shape == (*x.shape[:-1], x.shape[-1] // 2)
        and _checks.ready(grad, x)
    )


KERNELS = {
    "silu_mul": (silu_mul, supports_silu_mul),
    "silu_mul_backward": (silu_mul_backward, supports_silu_mul_backward),
    "swiglu": (swiglu, supports_swiglu),
    "swiglu_backward": (swiglu_backward, supports_swiglu_backward),
}
