"""Rotary position embedding: rotate-half and interleaved forms → ``spore.rope``.

Matched where the post-grad graph computes ``x * cos + rot(x) * sin`` with

- rotate-half (Hugging Face's ``apply_rotary_pos_emb``, Llama and its kin): ``rot(x) =
  cat(-x[..., D/2:], x[..., :D/2])``, the halves sliced or taken with ``x.chunk(2, -1)``;
- interleaved (GPT-J's ``rotate_every_two``): ``rot(x) = stack(-x[..., 1::2], x[..., ::2],
  -1).flatten(-2)``;

in either operand order of each product and of the sum (``cos * x``, ``sin * rot(x) + x * cos``;
IEEE products and sums commute exactly, so every order computes the same values), and
cos/sin of one shape whose last dimension is D and whose leading dimensions broadcast to
x's (the op's layout contract, checked with the op's own ``check``); the result must have x's
shape and dtype (tables of another dtype that promote the result are left alone). Tables of D
columns are passed as they are, so the rewrite uses exactly the model's values.

Numerics: spore.rope computes in float32 and rounds once to x's dtype; eager bfloat16 rounds
each product and the sum, Inductor's own fused code rounds once, like the op; with Inductor's
``emulate_precision_casts`` on, 16-bit forms are left alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

import spore
from mfusion.passes._match import floating, output_value, rounds_as_eager, value
from spore_kernels.ops.rope import check as contract  # importing it defines torch.ops.spore.*

EXAMPLE_X = (2, 3, 4, 8)
EXAMPLE_TABLE = (1, 3, 1, 8)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_chunks(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


Rotation = Callable[[torch.Tensor], torch.Tensor]
ROTATIONS: tuple[tuple[str, Rotation], ...] = (
    ("half", _rotate_half),
    ("half", _rotate_half_chunks),
    ("interleaved", _rotate_interleaved),
)


def _order(
    rotate: Rotation, cos_first: bool, sin_first: bool, rotated_first: bool
) -> Callable[..., torch.Tensor]:
    """``x * cos + rotate(x) * sin`` with the products' and the sum's operands so ordered."""

    def form(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated = rotate(x)
        plain = cos * x if cos_first else x * cos
        turned = sin * rotated if sin_first else rotated * sin
        return turned + plain if rotated_first else plain + turned

    return form


def _orders(rotate: Rotation) -> list[Callable[..., torch.Tensor]]:
    """The form in each operand order of the two products and the sum (HF's first)."""
    return [_order(rotate, *flags) for flags in itertools.product((False, True), repeat=3)]


def _replacement(mode: str) -> Any:
    def replacement(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.ops.spore.rope(x, cos, sin, mode)

    return replacement


def _check(mode: str) -> Any:
    def check(match: Any) -> bool:
        x, cos, sin = (value(match, n) for n in ("x", "cos", "sin"))
        out = output_value(match)
        if not (floating(x, out) and floating(cos, sin)) or out.shape != x.shape:
            return False
        if rounds_as_eager(x):
            return False
        if x.dim() < 1 or cos.dim() < 1 or cos.shape[-1] != x.shape[-1]:
            return False
        try:
            contract(x, cos, sin, mode)
        except (TypeError, ValueError):
            return False
        return True

    return check


def _examples() -> list[torch.Tensor]:
    return [torch.empty(EXAMPLE_X), torch.empty(EXAMPLE_TABLE), torch.empty(EXAMPLE_TABLE)]


class RopePass(spore.PatternToPatternPass):
    """``x * cos + rot(x) * sin`` (any operand order) → ``spore.rope(x, cos, sin, mode)``."""

    name = "rope"
    version = "3"
    on_cpu = False  # Inductor's fused C++ kernel is as fast; the op call costs more
    priority = 50
    summary = "RoPE: rotate-half (HF apply_rotary_pos_emb) and interleaved (GPT-J) -> spore.rope"
    reshape_views = True  # the interleaved form's flatten

    def search_forms(self) -> list[spore.SearchForm]:
        return [
            spore.SearchForm(form, _examples, _replacement(mode), _check(mode))
            for mode, rotate in ROTATIONS
            for form in _orders(rotate)
        ]


PASSES = (RopePass(),)
