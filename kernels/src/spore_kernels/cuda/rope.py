"""rope (rotary position embedding), forward and backward, one program per row of x.

Each row's cos/sin row is found from the row index through the op's broadcast ``layout`` (x's
leading dimensions merged into at most three groups, each with its step through the table), so
tables broadcast over batch, heads or sequence are read in place. Tables hold D values per row,
or D/2 (one angle per pair). In fp32, rounded once to x's dtype; the backward is the transpose
of the rotation (``dx = grad * cos - rot(grad * sin)``), as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spore_kernels import _checks
from spore_kernels.cuda import _common
from spore_kernels.ops.rope import MODES, layout


@triton.jit
def _rope(
    X,
    COS,
    SIN,
    Y,
    mid,
    inner,
    step_o,
    step_m,
    step_i,
    dim,
    table_cols,
    INTERLEAVED: tl.constexpr,
    HALF_TABLE: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    t = ((r // (inner * mid)) * step_o + (r // inner % mid) * step_m + (r % inner) * step_i) * (
        table_cols
    )
    row = r * dim
    half = dim // 2
    for start in range(0, half, BLOCK):
        j = start + tl.arange(0, BLOCK)
        mask = j < half
        if INTERLEAVED:  # pairs (2j, 2j + 1)
            ia = 2 * j
            ib = ia + 1
        else:  # pairs (j, j + D/2)
            ia = j
            ib = j + half
        if HALF_TABLE:
            ta = j
            tb = j
        else:
            ta = ia
            tb = ib
        a = tl.load(X + row + ia, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(X + row + ib, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(COS + t + ta, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t + tb, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t + ta, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t + tb, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            first = a * c1 + b * s2
            second = b * c2 - a * s1
        else:
            first = a * c1 - b * s1
            second = b * c2 + a * s2
        tl.store(Y + row + ia, first.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + row + ib, second.to(Y.dtype.element_ty), mask=mask)


def _run(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, transpose: bool
) -> torch.Tensor:
    y = torch.empty_like(x)
    rows, dim = _checks.rows_cols(x)
    if rows == 0 or dim == 0:
        return y
    _, mid, inner, step_o, step_m, step_i = layout(x.shape, cos.shape)
    size = _common.block(dim // 2)
    _rope[(rows,)](
        x,
        cos,
        sin,
        y,
        mid,
        inner,
        step_o,
        step_m,
        step_i,
        dim,
        cos.shape[-1],
        INTERLEAVED=mode == "interleaved",
        HALF_TABLE=cos.shape[-1] != dim,
        TRANSPOSE=transpose,
        BLOCK=size,
        num_warps=_common.warps(size),
    )
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    return _run(x, cos, sin, mode, transpose=False)


def rope_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> torch.Tensor:
    return _run(grad, cos, sin, mode, transpose=True)


def _broadcasts(table: torch.Size, batch: torch.Size) -> bool:
    """The table's leading dimensions broadcast to x's (each 1 or x's, aligned right)."""
    return len(table) <= len(batch) and all(
        t in (1, b)
        for t, b in zip(reversed(table), reversed(batch[len(batch) - len(table) :]), strict=True)
    )


def supports_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> bool:
    """x with an even last dimension D; cos and sin of one shape, D or D/2 columns, leading
    dimensions broadcasting to x's in a layout of at most three groups, of x's dtype or fp32."""
    if mode not in MODES or not _checks.ready(x) or x.dim() < 1:
        return False
    dim = x.shape[-1]
    return (
        dim % 2 == 0
        and cos.shape == sin.shape
        and cos.dim() >= 1
        and cos.shape[-1] in (dim, dim // 2)
        and cos.dtype in (x.dtype, torch.float32)
        and _checks.ready(cos, sin)
        and cos.device == x.device
        and _broadcasts(cos.shape[:-1], x.shape[:-1])
        and layout(x.shape, cos.shape) is not None
    )


def supports_rope_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> bool:
    return supports_rope(grad, cos, sin, mode)


KERNELS = {
    "rope": (rope, supports_rope),
    "rope_backward": (rope_backward, supports_rope_backward),
}
