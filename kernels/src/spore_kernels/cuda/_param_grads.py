"""The weight and bias gradients of the row norms: column sums over all rows of ``g * xhat``
(dweight) and ``g`` (dbias), with xhat rebuilt from x and what the dx kernel saved per row:
rstd, and for layer_norm the shift and offset that centre x as (x - shift) - offset. One program
per (column block, group of rows) writes fp32 partial sums; the groups' partials are added in
fp32 and rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 32  # rows per step of a program
COLS = 64  # columns per program
MAX_GROUPS = 128  # row groups (programs down the columns) at most


@triton.jit
def _param_grads(
    G,
    X,
    SHIFT,
    OFFSET,
    RSTD,
    DW,
    DB,
    rows,
    cols,
    rows_per_group,
    CENTRED: tl.constexpr,
    HAS_DW: tl.constexpr,
    HAS_DB: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    group = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    col_mask = offs < cols
    first = group * rows_per_group
    last = tl.minimum(first + rows_per_group, rows)
    acc_w = tl.zeros([BM, BN], dtype=tl.float32)
    acc_b = tl.zeros([BM, BN], dtype=tl.float32)
    for start in range(first, last, BM):
        rws = start + tl.arange(0, BM)
        row_mask = rws < last
        mask = row_mask[:, None] & col_mask[None, :]
        at = rws[:, None] * cols + offs[None, :]
        g = tl.load(G + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_DW:
            x = tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
            if CENTRED:
                shift = tl.load(SHIFT + rws, mask=row_mask, other=0.0)[:, None]
                x = (x - shift) - tl.load(OFFSET + rws, mask=row_mask, other=0.0)[:, None]
            acc_w += g * x * tl.load(RSTD + rws, mask=row_mask, other=0.0)[:, None]
        if HAS_DB:
            acc_b += g
    if HAS_DW:
        tl.store(DW + group * cols + offs, tl.sum(acc_w, axis=0), mask=col_mask)
    if HAS_DB:
        tl.store(DB + group * cols + offs, tl.sum(acc_b, axis=0), mask=col_mask)


def param_grads(
    grad: torch.Tensor,
    x: torch.Tensor,
    centre: tuple[torch.Tensor, torch.Tensor] | None,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dweight, dbias) for [rows, cols] ``grad`` and ``x`` (``None`` for an absent parameter);
    ``centre`` is each row's (shift, offset), xhat = ((x - shift) - offset) * rstd, or ``None``
    for rms norms (xhat = x * rstd)."""
    cols = x.shape[-1]
    rows = x.numel() // cols
    if rows == 0:
        return (
            None if weight is None else torch.zeros_like(weight),
            None if bias is None else torch.zeros_like(bias),
        )
    per_group = triton.cdiv(triton.cdiv(rows, min(triton.cdiv(rows, ROWS), MAX_GROUPS)), ROWS)
    per_group *= ROWS
    groups = triton.cdiv(rows, per_group)

    def partial(param: torch.Tensor | None) -> torch.Tensor:
        size = (groups, cols) if param is not None else (1,)  # an unwritten placeholder
        return torch.empty(size, dtype=torch.float32, device=x.device)

    dw, db = partial(weight), partial(bias)
    bn = min(triton.next_power_of_2(cols), COLS)
    shift, offset = (rstd, rstd) if centre is None else centre  # unread placeholders if None
    _param_grads[(triton.cdiv(cols, bn), groups)](
        grad,
        x,
        shift,
        offset,
        rstd,
        dw,
        db,
        rows,
        cols,
        per_group,
        CENTRED=centre is not None,
        HAS_DW=weight is not None,
        HAS_DB=bias is not None,
        BM=ROWS,
        BN=bn,
    )
    return (
        None if weight is None else dw.sum(0).to(weight.dtype),
        None if bias is None else db.sum(0).to(bias.dtype),
    )
