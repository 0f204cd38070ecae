"""Rotary position embedding: rotate-half and interleaved forms → ``spore.rope``.

Matched where the post-grad graph computes ``x * cos + rot(x) * sin`` with

- rotate-half (Hugging Face's ``apply_rotary_pos_emb``, Llama and its kin): ``rot(x) =
  cat(-x[..., D/2:], x[..., :D/2])``;
- interleaved (GPT-J's ``rotate_every_two``): ``rot(x) = stack(-x[..., 1::2], x[..., ::2],
  -1).flatten(-2)``;

and cos/sin of one shape whose last dimension is D and whose leading dimensions broadcast to
x's (the op's layout contract, checked with the op's own ``check``); the result must have x's
shape and dtype (tables of another dtype that promote the result are left alone). Tables of D
columns are passed as they are, so the rewrite uses exactly the model's values.

Numerics: spore.rope computes in float32 and rounds once to x's dtype; eager bfloat16 rounds
each product and the sum, Inductor's own fused code rounds once, like the op; with Inductor's
``emulate_precision_casts`` on, 16-bit forms are left alone.
"""

from __future__ import annotations

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


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_interleaved(x) * sin


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
    """``x * cos + rot(x) * sin`` → ``spore.rope(x, cos, sin, "half" | "interleaved")``."""

    name = "rope"
    version = "2"
    on_cpu = False  # Inductor's fused C++ kernel is as fast; the op call costs more
    priority = 50
    summary = "RoPE: rotate-half (HF apply_rotary_pos_emb) and interleaved (GPT-J) -> spore.rope"
    reshape_views = True  # the interleaved form's flatten

    def search_forms(self) -> list[spore.SearchForm]:
        return [
            spore.SearchForm(_half, _examples, _replacement("half"), _check("half")),
            spore.SearchForm(
                _interleaved, _examples, _replacement("interleaved"), _check("interleaved")
            ),
        ]


PASSES = (RopePass(),)
