"""gelu, forward and backward, elementwise in fp32 and rounded once to x's dtype.

The exact form is ``0.5 x (1 + erf(x / sqrt 2))`` like the reference (``F.gelu``), so it shares
its cancellation below x = -4 (an absolute error under 1e-7 |x|); the tanh form is written as
``x * sigmoid(2u)``, u = sqrt(2/pi) (x + 0.044715 x^3), which saturates to x and -0 without
overflow trouble.
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


@triton.jit
def _gelu_fwd(X, Y, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = SQRT_2_OVER_PI * (x + K1 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * u))
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * SQRT_HALF))
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
        d = 0.5 * (1.0 + tl.math.erf(x * SQRT_HALF)) + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)
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
