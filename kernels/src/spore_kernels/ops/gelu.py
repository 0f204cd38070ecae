"""``gelu(x, approximate="none")`` and its backward.

``approximate="none"`` is the exact ``x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))``; ``"tanh"`` is
``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, both as ``torch.nn.functional.gelu``.

Numerics contract: computed in float32 whatever the input dtype (float64 stays float64) and
rounded once to x's dtype. The C++ kernel evaluates erfc with its own vectorised polynomials and
carries the rounding errors of its argument, so its float32 exact gelu is within 4 ulp of the
true value over all of float32 in the FMA builds (v3, v4; 7 ulp in the baseline build); torch's
float32 F.gelu is within 5 ulp for x > -1 but loses every digit below x = -4, where ``1 + erf``
cancels. It writes the tanh form as ``x * sigmoid(2y)``: no cancellation; within 3.5 ulp for x >
-1, and a relative error below ``(2 |2y| + 8) 2^-23`` (1e-5 at x = -10) in the negative tail,
where ``exp(-2y)`` amplifies the rounding of 2y. For bfloat16 and float16 the kernel looks each
result up in a table of all 65536 inputs built once by the float32 code: bitwise the float32
result rounded once. Limits: gelu(+inf) = +inf and gelu(-inf) = -0 (torch's float32 F.gelu gives
NaN at -inf, and at +inf in the exact form); NaN stays NaN.
Backward: ``gelu_backward(grad, x, approximate) -> dx`` in closed form; the kernel's exact-form
derivative is within 3e-7 of the true one (short polynomials for every dtype).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from spore_kernels import _checks, _lib

SCHEMA = '(Tensor x, str approximate="none") -> Tensor'
BACKWARD_SCHEMA = '(Tensor grad, Tensor x, str approximate="none") -> Tensor'
APPROXIMATIONS = ("none", "tanh")
TANH_K0 = math.sqrt(2.0 / math.pi)
TANH_K1 = 0.044715


def check(x: torch.Tensor, approximate: str) -> None:
    """Clear errors for the inputs gelu cannot take."""
    _checks.floating("gelu", x=x)
    if approximate not in APPROXIMATIONS:
        raise ValueError(
            f"gelu: approximate must be one of {', '.join(map(repr, APPROXIMATIONS))}, "
            f"got {approximate!r}"
        )


TAIL = -1e4
"""Below it both forms are -0 in every dtype: -inf is clamped there, as the kernel's -0."""
HEAD = 1e4
"""Above it both forms are x, and their derivative 1, in every dtype: their gates are worked
out no higher (the tanh form's cube, and its derivative's ``x * 0``, gave NaN up there)."""


def reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The kernel's cancellation-free forms, ``0.5 x erfc(-x / sqrt 2)`` and ``x sigmoid(2y)``
    (F.gelu's ``1 + erf`` and ``1 + tanh`` lose every digit of the negative tail), the sigmoid
    as ``exp(logsigmoid)``, which stays above 0 where ``sigmoid`` underflows but the product
    does not; it also runs under torch.func transforms and forward-mode AD, whose
    derivatives it gives."""
    check(x, approximate)
    xf = x.to(_checks.compute_dtype(x)).clamp(min=TAIL)
    xs = xf.clamp(max=HEAD)  # also where x is not taken: its zero gradient must stay finite
    if approximate == "tanh":
        gated = xs * torch.exp(F.logsigmoid(2 * _tanh_arg(xs)))
    else:
        gated = 0.5 * xs * torch.erfc(-xs * math.sqrt(0.5))
    return torch.where(xf > HEAD, xf, gated).to(x.dtype)


def _tanh_arg(x: torch.Tensor) -> torch.Tensor:
    return TANH_K0 * (x + TANH_K1 * x * x * x)


def reference_backward(
    grad: torch.Tensor, x: torch.Tensor, approximate: str = "none"
) -> torch.Tensor:
    """The closed form: Phi(x) + x phi(x) (exact), or the tanh form's ``s + 2 x s (1 - s) y'``
    for ``s = sigmoid(2y)`` (no ``1 + tanh`` to cancel)."""
    check(x, approximate)
    _checks.upstream("gelu_backward", x.shape, grad=grad)
    compute = _checks.compute_dtype(x)
    xf, gf = x.to(compute).clamp(min=TAIL, max=HEAD), grad.to(compute)
    if approximate == "tanh":
        y = _tanh_arg(xf)
        s = torch.exp(F.logsigmoid(2 * y))
        slope = TANH_K0 * (1 + 3 * TANH_K1 * xf * xf)
        d = s + 2 * xf * s * torch.sigmoid(-2 * y) * slope
    else:
        d = 0.5 * torch.erfc(-xf * math.sqrt(0.5)) + xf * torch.exp(-0.5 * xf * xf) / math.sqrt(
            2 * math.pi
        )
    return (gf * d).to(x.dtype)


def supports(x: torch.Tensor, approximate: str = "none") -> bool:
    """Contiguous CPU x of one kernel dtype and a known approximation."""
    return approximate in APPROXIMATIONS and _checks.ready(x, device_type="cpu")


def supports_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> bool:
    return (
        supports(x, approximate)
        and _checks.ready(grad, x, device_type="cpu")
        and grad.shape == x.shape
    )


_FWD = (_lib.ptr, _lib.ptr, _lib.i64, _lib.i32, _lib.i32, _lib.i32)
_BWD = (_lib.ptr, _lib.ptr, _lib.ptr, _lib.i64, _lib.i32, _lib.i32, _lib.i32)


def _cpu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel():
        mode = APPROXIMATIONS.index(approximate)
        args = (x.data_ptr(), y.data_ptr(), x.numel(), mode, _lib.dtype_code(x), _lib.threads())
        _lib.call("spore_gelu", _FWD, *args)
    return y


def _cpu_backward(grad: torch.Tensor, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    dx = torch.empty_like(x)
    if x.numel():
        ptrs = (grad.data_ptr(), x.data_ptr(), dx.data_ptr())
        mode = APPROXIMATIONS.index(approximate)
        args = (*ptrs, x.numel(), mode, _lib.dtype_code(x), _lib.threads())
        _lib.call("spore_gelu_backward", _BWD, *args)
    return dx


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, approximate = inputs
    ctx.save_for_backward(x)
    ctx.approximate = approximate


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    (x,) = ctx.saved_tensors
    return torch.ops.spore.gelu_backward(grad.contiguous(), x, ctx.approximate), None


cpu = _checks.direct("gelu", _cpu, supports)


cpu_backward = _checks.direct("gelu_backward", _cpu_backward, supports_backward)


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define("gelu_backward", BACKWARD_SCHEMA, reference=reference_backward)
    registry.kernel(
        bwd, "cpu", _cpu_backward, priority=_checks.PRIORITY, supports=supports_backward
    )
    fwd = registry.define(
        "gelu", SCHEMA, reference=reference, backward=_backward, setup_context=_setup_context
    )
    registry.kernel(fwd, "cpu", _cpu, priority=_checks.PRIORITY, supports=supports)


def composite(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU a user writes, in float32: 0.5 x (1 + erf(x / sqrt 2))."""
    xf = x.float()
    return (0.5 * xf * (1 + torch.erf(xf * math.sqrt(0.5)))).to(x.dtype)


def composite_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU a user writes, in float32."""
    xf = x.float()
    return (0.5 * xf * (1 + torch.tanh(TANH_K0 * (xf + TANH_K1 * xf.pow(3))))).to(x.dtype)


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    def make(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor]:
        return ((torch.randn(8192, 4096, generator=g) * 2).to(dtype),)

    return [
        OpBench(
            op="gelu",
            shape="8192x4096",
            make=make,
            spore=lambda x: torch.ops.spore.gelu(x, "none"),
            baselines={
                "eager": ("eager composite 0.5*x*(1+erf(x/sqrt2)) in fp32", composite),
                "F.gelu": ("torch.nn.functional.gelu", F.gelu),
            },
        ),
        OpBench(
            op="gelu_tanh",
            shape="8192x4096",
            make=make,
            spore=lambda x: torch.ops.spore.gelu(x, "tanh"),
            baselines={
                "eager": ("eager composite 0.5*x*(1+tanh(...)) in fp32", composite_tanh),
                "F.gelu": (
                    "torch.nn.functional.gelu(approximate='tanh')",
                    lambda x: F.gelu(x, approximate="tanh"),
                ),
            },
        ),
    ]
