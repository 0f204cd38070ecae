"""`Transition` (AF3 algorithm 11): layer norm, then a SwiGLU feed-forward of ``n * c_in`` hidden
channels, chunked over rows so the hidden activations never exist for the whole input."""

from __future__ import annotations

import math

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

Index = tuple[int | slice, ...]


def row_blocks(dims: tuple[int, ...], start: int, stop: int) -> list[Index]:
    """Indexes into leading dims ``dims`` whose views together hold rows ``start:stop`` of
    ``dims`` flattened (row-major): at most ``2 * len(dims) - 1`` strided views of any tensor,
    contiguous or not."""
    if start >= stop:
        return []
    if not dims:
        return [()]
    inner = math.prod(dims[1:])
    (first, head), (last, tail) = divmod(start, inner), divmod(stop, inner)
    if first == last:
        return [(first, *rest) for rest in row_blocks(dims[1:], head, tail)]
    blocks: list[Index] = []
    if head:
        blocks += [(first, *rest) for rest in row_blocks(dims[1:], head, inner)]
        first += 1
    if first < last:
        blocks.append((slice(first, last),))
    return blocks + [(last, *rest) for rest in row_blocks(dims[1:], 0, tail)]


class Transition(nn.Module):
    """``linear_no_bias(silu(linear_no_bias_a(y)) * linear_no_bias_b(y))``, ``y = layernorm1(x)``.

    Parameters as Protenix's ``Transition(c_in, n)``. A chunk is ``chunk_size`` rows of ``x``
    [..., L, c_in] with its leading dims flattened, a row being one [L, c_in] slice (a row ``i``
    of a pair tensor [*, N, N, c], a sequence of a batched single tensor, an MSA row); a 2-D
    ``x`` is one row and runs whole. The plan field is ``transition``.
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
        """The update for ``x`` [..., L, c_in]; with in-place inference asked for
        (``inplace_safe`` or ``plan.inplace``) and ``_add_with_inplace``, ``x + update`` instead,
        accumulated in ``x`` itself when no gradient is needed (chunk by chunk through strided
        views: ``x`` need not be contiguous)."""
        check_channels("x", x, self.c_in, "[..., L, c_in]", 2, self)
        size = plan_chunk_size(self, "transition", chunk_size)
        add = _add_with_inplace and inplace_requested(self, inplace_safe)
        count = x.shape[:-2].numel()
        if add and grad_free(self, x):
            step = max(count, 1) if size is None else size
            for start in range(0, count, step):
                for index in row_blocks(x.shape[:-2], start, min(start + step, count)):
                    rows = x[index]
                    rows += self._update(rows)
            return x
        rows = x.reshape(count, *x.shape[-2:])  # not -1: ambiguous for an empty x
        update = chunked(
            lambda sl, rows: self._update(rows),
            count,
            size,
            0,
            args=(rows,),
            recompute=chunk_recompute(self, size),
            split=0,
        ).view(x.shape)
        return x + update if add else update
