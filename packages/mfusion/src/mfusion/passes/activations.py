"""GELU, SiLU·mul and SwiGLU: their post-grad forms rewritten into ``torch.ops.spore`` ops.

Post-grad graphs hold activations decomposed: ``F.gelu`` as ``0.5 x (1 + erf(x / sqrt 2))``,
its tanh form as ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x x x)))``, ``F.silu`` as
``x / (1 + exp(-x))``; for bfloat16/float16 inputs between a cast to float32 and a cast back.
Each form is matched with its exact constants (another constant is another function, left
alone) and in both operand orders of the final product.

Numerics: the spore ops compute in float32 and round once to the input dtype. That is what
the float32 and the cast-wrapped forms compute; for a form written in bfloat16 without casts
(GPT-2's hand-written GELU, a SiLU whose float32 result is cast back before ``* b``) eager
rounds in between, and the rewrite rounds once, as Inductor's own generated code does. With
Inductor's ``emulate_precision_casts`` on, 16-bit forms are left alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import spore

# defines torch.ops.spore.*: the replacements call them, and so does a compiled graph the FX graph
# cache serves in a fresh process, where no pass runs (mfusion registers its passes from here)
import spore_kernels  # noqa: F401
from mfusion.passes._match import floating, output_value, rounds_as_eager, value

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


def _gelu_forms(
    formulas: Sequence[tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype]],
    approximate: str,
) -> list[spore.SearchForm]:
    """Each formula traced in its dtype (``F.gelu`` in bfloat16 traces with casts)."""

    def replacement(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.spore.gelu(x, approximate)

    return [
        spore.SearchForm(formula, _examples((8, 16), dtype=dtype), replacement)
        for formula, dtype in formulas
    ]


class GeluPass(spore.PatternToPatternPass):
    """Exact and tanh GELU, as ``F.gelu`` decomposes or as Hugging Face writes them."""

    name = "gelu"
    version = "2"
    priority = 50
    summary = "GELU (exact erf form; tanh form incl. GPT-2's hand-written one) -> spore.gelu"
    reshape_views = True

    def extra_check(self, match: Any) -> bool:
        x = value(match, "x")
        return _same_shape_and_dtype(x, output_value(match)) and not rounds_as_eager(x)

    def search_forms(self) -> list[spore.SearchForm]:
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


def _gated_forms(
    products: Callable[[Callable[[torch.Tensor], torch.Tensor]], list[Callable[..., Any]]],
    *shapes: tuple[int, ...],
) -> list[spore.SearchForm]:
    """``products(silu)`` (gate first, gate last) for each SiLU form, traced in its dtype."""
    return [
        spore.SearchForm(product, _examples(*shapes, dtype=dtype))
        for silu, dtype in _SILUS
        for product in products(silu)
    ]


def _silu_mul_patterns(
    silu: Callable[[torch.Tensor], torch.Tensor],
) -> list[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    def gate_first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return silu(a) * b

    def gate_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return b * silu(a)

    return [gate_first, gate_last]


class SiluMulPass(spore.PatternToPatternPass):
    """``silu(a) * b`` (Llama's MLP gate): ``spore.silu_mul(a, b)``, b broadcasting to a."""

    name = "silu_mul"
    version = "2"
    priority = 40
    summary = "silu(a) * b (Llama MLP gate; F.silu or a * sigmoid(a)) -> spore.silu_mul"
    reshape_views = True

    def replacement(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.spore.silu_mul(a, b)

    def extra_check(self, match: Any) -> bool:
        a, b, out = value(match, "a"), value(match, "b"), output_value(match)
        if not (floating(a, b, out) and b.dim() <= a.dim()) or rounds_as_eager(a):
            return False
        return torch.broadcast_shapes(a.shape, b.shape) == a.shape == out.shape

    def search_forms(self) -> list[spore.SearchForm]:
        return _gated_forms(_silu_mul_patterns, (8, 16), (8, 16))


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


class SwigluPass(spore.PatternToPatternPass):
    """A fused gate/up projection's halves: ``silu(first) * second`` → ``spore.swiglu(x)``.

    spore's swiglu gates with the FIRST half of x's last dimension (Phi-3's
    ``gate, up = x.chunk(2, -1)``); a graph that gates with the second half is left alone.
    Runs before :class:`SiluMulPass`, which would otherwise take the product of the halves.
    """

    name = "swiglu"
    version = "2"
    priority = 45
    summary = "chunk(2, -1) then silu(gate) * up (fused gate_up projection) -> spore.swiglu"
    reshape_views = True

    def replacement(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.spore.swiglu(x)

    def extra_check(self, match: Any) -> bool:
        x, out = value(match, "x"), output_value(match)
        return (
            floating(x, out)
            and not rounds_as_eager(x)
            and x.dim() >= 1
            and x.shape[-1] % 2 == 0
            and out.shape == (*x.shape[:-1], x.shape[-1] // 2)
        )

    def search_forms(self) -> list[spore.SearchForm]:
        return _gated_forms(_swiglu_patterns, (8, 16))


PASSES = (GeluPass(), SwigluPass(), SiluMulPass())
