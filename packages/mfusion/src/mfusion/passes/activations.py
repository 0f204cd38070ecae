"""GELU, SiLU·mul and SwiGLU: their post-grad forms rewritten into ``torch.ops.spore`` ops.

Post-grad graphs hold activations decomposed: ``F.gelu`` as ``0.5 x (1 + erf(x / sqrt 2))``,
its tanh form as ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x x x)))``, ``F.silu`` as
``x / (1 + exp(-x))``; for bfloat16/float16 inputs between a cast to float32 and a cast back.
Each form is matched with its exact constants (another constant is another function, left
alone) and in both operand orders of the final product.

Numerics: the spore ops compute in float32 and round once to the input dtype. That is what
the float32 and the cast-wrapped forms compute; for a form written in bfloat16 without casts
(GPT-2's hand-written GELU, a SiLU whose float32 result is cast back before ``* b``) eager
rounds in between, and the rewrite rounds once, as Inductor's own generated code does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mfusion.passes._forms import Form, FormsPass, floating, output_value, value

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
TANH_CUBIC = 0.044715
LOW_PRECISION = torch.bfloat16


def _examples(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Callable[[], list]:
    return lambda: [torch.empty(shape, dtype=dtype) for shape in shapes]


def _traced_in_both(
    library: Callable[..., Any], written: Callable[..., Any]
) -> tuple[tuple[Callable[..., Any], torch.dtype], ...]:
    """A library function's form in float32 and bfloat16 (which upcasts), a hand-written one's
    in float32 (bfloat16 traces the same graph)."""
    return ((library, torch.float32), (library, LOW_PRECISION), (written, torch.float32))


def _same_shape_and_dtype(x: Any, out: Any) -> bool:
    return floating(x, out) and out.shape == x.shape


# GELU -------------------------------------------------------------------------------------


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def _gelu_erf_python(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``GELUActivation(use_gelu_python=True)``."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_tanh_pow(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's / Hugging Face's ``NewGELUActivation``."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + TANH_CUBIC * torch.pow(x, 3.0))))


def _gelu_check(match: Any) -> bool:
    return _same_shape_and_dtype(value(match, "x"), output_value(match))


def _gelu_forms(
    formulas: Sequence[tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]],
    approximate: str,
) -> list[Form]:
    """Each formula traced in its dtype (``F.gelu`` in bfloat16 traces with casts)."""

    def replacement(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.spore.gelu(x, approximate)

    return [
        Form(formula, replacement, _examples((8, 16), dtype=dtype), _gelu_check)
        for formula, dtype in formulas
    ]


class GeluPass(FormsPass):
    """Exact and tanh GELU, as ``F.gelu`` decomposes or as Hugging Face writes them."""

    name = "gelu"
    version = "1"
    priority = 50
    summary = "GELU (exact erf form; tanh form incl. GPT-2's hand-written one) -> spore.gelu"

    def forms(self) -> list[Form]:
        return [
            *_gelu_forms(_traced_in_both(_gelu_erf, _gelu_erf_python), "none"),
            *_gelu_forms(_traced_in_both(_gelu_tanh, _gelu_tanh_pow), "tanh"),
        ]


# SiLU * b and SwiGLU ----------------------------------------------------------------------


def _silu(a: torch.Tensor) -> torch.Tensor:
    return F.silu(a)


def _silu_sigmoid(a: torch.Tensor) -> torch.Tensor:
    return a * torch.sigmoid(a)


_SILUS = _traced_in_both(_silu, _silu_sigmoid)


def _silu_mul_patterns(
    silu: Callable[[torch.Tensor], torch.Tensor],
) -> list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    def gate_first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return silu(a) * b

    def gate_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return b * silu(a)

    return [gate_first, gate_last]


def _silu_mul_replacement(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.spore.silu_mul(a, b)


def _silu_mul_check(match: Any) -> bool:
    a, b, out = value(match, "a"), value(match, "b"), output_value(match)
    if not (floating(a, b, out) and b.dim() <= a.dim()):
        return False
    return torch.broadcast_shapes(a.shape, b.shape) == a.shape == out.shape


class SiluMulPass(FormsPass):
    """``silu(a) * b`` (Llama's MLP gate): ``spore.silu_mul(a, b)``, b broadcasting to a."""

    name = "silu_mul"
    version = "1"
    priority = 40
    summary = "silu(a) * b (Llama MLP gate; F.silu or a * sigmoid(a)) -> spore.silu_mul"

    def forms(self) -> list[Form]:
        examples = {d: _examples((8, 16), (8, 16), dtype=d) for _, d in _SILUS}
        return [
            Form(pattern, _silu_mul_replacement, examples[dtype], _silu_mul_check)
            for silu, dtype in _SILUS
            for pattern in _silu_mul_patterns(silu)
        ]


def _swiglu_patterns(
    silu: Callable[[torch.Tensor], torch.Tensor],
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    def gate_first(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return silu(gate) * up

    def gate_last(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return up * silu(gate)

    return [gate_first, gate_last]


def _swiglu_replacement(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.spore.swiglu(x)


def _swiglu_check(match: Any) -> bool:
    x, out = value(match, "x"), output_value(match)
    return (
        floating(x, out)
        and x.dim() >= 1
        and x.shape[-1] % 2 == 0
        and out.shape == (*x.shape[:-1], x.shape[-1] // 2)
    )


class SwigluPass(FormsPass):
    """A fused gate/up projection's halves: ``silu(first) * second`` → ``spore.swiglu(x)``.

    spore's swiglu gates with the FIRST half of x's last dimension (Phi-3's
    ``gate, up = x.chunk(2, -1)``); a graph that gates with the second half is left alone.
    Runs before :class:`SiluMulPass`, which would otherwise take the product of the halves.
    """

    name = "swiglu"
    version = "1"
    priority = 45
    summary = "chunk(2, -1) then silu(gate) * up (fused gate_up projection) -> spore.swiglu"

    def forms(self) -> list[Form]:
        return [
            Form(pattern, _swiglu_replacement, _examples((8, 16), dtype=dtype), _swiglu_check)
            for silu, dtype in _SILUS
            for pattern in _swiglu_patterns(silu)
        ]


PASSES = (GeluPass(), SwigluPass(), SiluMulPass())
