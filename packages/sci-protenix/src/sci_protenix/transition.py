"""`Transition` (AF3 algorithm 11): layer norm, then a SwiGLU feed-forward of ``n * c_in`` hidden
channels, chunked over rows so the hidden activations never exist for the whole input."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sci_protenix.chunking import (
    chunk_recompute,
    chunked,
    grad_free,
    inplace_requested,
    plan_chunk_size,
)
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.primitives import Linear, check_channels, layer_norm


class Transition(nn.Module):
    """``linear_no_bias(silu(linear_no_bias_a(y)) * linear_no_bias_b(y))``, ``y = layernorm1(x)``.

    Parameters as Protenix's ``Transition(c_in, n)``. A chunk is ``chunk_size`` rows, a row being
    the positions along ``x``'s second-to-last axis (one row ``i`` of a pair tensor [*, N, N, c];
    one sequence of a batched single tensor); the plan field is ``transition``.
    """

    plan: MemoryPlan | None = None

    def __init__(self, c_in: int, n: int) -> None:
        super().__init__()
        self.c_in = c_in
        self.n = n
        self.layernorm1 = layer_norm(c_in)
        self.linear_no_bias_a = Linear(c_in, n * c_in, bias=False, init="relu")
        self.linear_no_bias_b = Linear(c_in, n * c_in, bias=False, init="relu")
        self.linear_no_bias = Linear(n * c_in, c_in, bias=False, init="final")

    def _update(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layernorm1(x)
        return self.linear_no_bias(F.silu(self.linear_no_bias_a(x)) * self.linear_no_bias_b(x))

    def forward(
        self,
        x: torch.Tensor,
        chunk_size: int | None = None,
        inplace_safe: bool = False,
        _add_with_inplace: bool = False,
    ) -> torch.Tensor:
        """The update for ``x`` [..., c_in]; with in-place inference asked for (``inplace_safe``
        or ``plan.inplace``) and ``_add_with_inplace``, ``x + update`` instead, accumulated in
        ``x`` itself when no gradient is needed."""
        check_channels("x", x, self.c_in, "[..., L, c_in]", 2, self)
        size = plan_chunk_size(self, "transition", chunk_size)
        add = _add_with_inplace and inplace_requested(self, inplace_safe)
        inplace = add and x.is_contiguous() and grad_free(self, x)
        shape = (x.shape[:-2].numel(), *x.shape[-2:])  # not -1: ambiguous for an empty x
        rows = x.view(shape) if inplace else x.reshape(shape)
        update = chunked(
            lambda sl, rows: self._update(rows),
            rows.shape[0],
            size,
            0,
            args=(rows,),
            out=rows if inplace else None,
            accumulate=inplace,
            recompute=chunk_recompute(self, size),
            split=0,
        ).view(x.shape)
        if add and not inplace:
            return x + update
        return update
