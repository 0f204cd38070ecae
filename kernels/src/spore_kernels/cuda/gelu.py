"""gelu, forward and backward, elementwise in fp32 and rounded once to x's dtype.

The exact form is the reference's ``0.5 x erfc(-x / sqrt 2)``, free of the ``1 + erf``
cancellation below x = -4: ``0.5 erfc(|x| / sqrt 2)`` is ``exp(-x^2 / 2)`` times the C++
kernel's erfcx polynomial (its short one, within 1.4e-7) in ``w = 1 / (|x| / sqrt 2 + 3) - 1/6``,
taken as it is for x <= 0 and from 1 for x > 0. The tanh form is written as ``x * sigmoid(2u)``,
u = sqrt(2/pi) (x + 0.044715 x^3), which saturates to x and -0 without overflow trouble.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spore_kernels import _checks

BLOCK = 1024
SQRT_HALF = tl.constexpr(0.7071067811865476)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
K1 = tl.constexpr(0.044715)
SIXTH = tl.constexpr(0.16666666666666666)
BOUND = tl.constexpr(16.0)  # beyond: gelu(x) = x (x > 0) or -0 (x < 0) in fp32


@triton.jit
def _half_erfc(xa):
    # 0.5 erfc(xa / sqrt 2) for 0 <= xa <= BOUND: 0.5 (t + 3) erfcx(t) is a polynomial in
    # w = 1 / (t + 3) - 1/6 (csrc/gelu.cpp's erfcx_poly_short), t = xa / sqrt 2
    inv = 1.0 / (xa * SQRT_HALF + 3.0)
    w = inv - SIXTH
    p = -411.097809 * w - 37.8334732
    p = p * w + 104.360306
    p = p * w + 77.5228729
    p = p * w + 33.5298882
    p = p * w + 10.6239471
    p = p * w + 2.65018392
    p = p * w + 0.537003517
    return p * inv * tl.exp(-0.5 * xa * xa)


@triton.jit
def _gelu_fwd(X, Y, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = SQRT_2_OVER_PI * (x + K1 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * u))
    else:
        xa = tl.abs(x)
        m = x * _half_erfc(tl.minimum(xa, BOUND))  # x Phi(-|x|)
        y = tl.where(x > 0, x - m, m)
        y = tl.where(xa >= BOUND, tl.where(x > 0, x, -0.0), y)  # inf too (inf * 0 is NaN)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd(G, X, DX, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    # exact: Phi(x) + x phi(x); tanh: 0.5 (1 + t) + 0.5 x (1 - t^2) u', t = tanh(u)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = SQRT_2_OVER_PI * (x + K1 * x * x * x)
        half_1p_t = 1.0 / (1.0 + tl.exp(-2.0 * u))  # 0.5 (1 + t) = sigmoid(2u)
        one_m_t2 = 4.0 * half_1p_t * (1.0 - half_1p_t)  # 1 - t^2
        d = half_1p_t + 0.5 * x * one_m_t2 * SQRT_2_OVER_PI * (1.0 + 3.0 * K1 * x * x)
    else:
        half = _half_erfc(tl.minimum(tl.abs(x), BOUND))  # Phi(-|x|)
        d = tl.where(x > 0, 1.0 - half, half) + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    tl.store(DX + offs, (g * d).to(DX.dtype.element_ty), mask=mask)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        _gelu_fwd[(triton.cdiv(n, BLOCK),)](x, y, n, TANH=approximate == "tanh", BLOCK=BLOCK)
    return y


def gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    dx = torch.empty_like(x)
    n = x.numel()
    if n:
        tanh = approximate == "tanh"
        _gelu_bwd[(triton.cdiv(n, BLOCK),)](grad, x, dx, n, TANH=tanh, BLOCK=BLOCK)
    return dx


def supports_gelu(x: torch.Tensor, approximate: str = "none") -> bool:
    return approximate in ("none", "tanh") and _checks.ready(x)


def supports_gelu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> bool:
    return supports_gelu(x, approximate) and _checks.ready(grad, x) and grad.shape == x.shape


KERNELS = {
    "gelu": (gelu, supports_gelu),
    "gelu_backward": (gelu_backward, supports_gelu_backward),
}
