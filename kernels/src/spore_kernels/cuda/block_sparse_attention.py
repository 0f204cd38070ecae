"""block_sparse_attention on CUDA through ``torch.nn.attention.flex_attention`` (no Triton kernel
of our own): the block lists become a ``BlockMask`` (``BlockMask.from_kv_blocks``, each listed
block a full block) and ``torch.compile``'d flex_attention visits only those blocks. The
mask_mod repeats the lists element by element: flex_attention's eager path, which ignores the
block structure, then computes the same result (so the mapping is testable on CPU)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from spore_kernels import _checks
from spore_kernels.ops import block_sparse_attention as op


def block_mask(
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    sq: int,
    skv: int,
) -> Any:
    """The flex_attention ``BlockMask`` of these block lists (checked first)."""
    from torch.nn.attention.flex_attention import BlockMask

    op.check_index(kv_block_index, kv_block_count, block_size, sq, skv)
    nk = op.blocks(skv, block_size)
    width = min(kv_block_index.shape[-1], nk)  # distinct ids in 0..nk-1: a count is at most nk
    count = kv_block_count.to(torch.int32)
    listed = torch.arange(width, device=count.device) < count.unsqueeze(-1)
    ids = torch.where(listed, kv_block_index[..., :width].to(torch.int32), 0)
    ids = torch.nn.functional.pad(ids, (0, nk - width)).contiguous()  # BlockMask: nk columns
    allowed = op.dense_block_table(kv_block_index, kv_block_count, nk)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return allowed[b, h, q_idx // block_size, kv_idx // block_size]

    return BlockMask.from_kv_blocks(
        torch.zeros_like(count),  # no partial blocks: every listed block is fully attended
        torch.zeros_like(ids),
        full_kv_num_blocks=count,
        full_kv_indices=ids,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(sq, skv),
        compute_q_blocks=False,  # forward only: the op's gradient is the reference's
    )


@cache
def _compiled() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # shapes stay fixed within a model


def _tile(block_size: int) -> int:
    """flex_attention's query and key tile: the largest power of two dividing the block, <= 128."""
    return min(128, block_size & -block_size)


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    op.check(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    mask = block_mask(kv_block_index, kv_block_count, block_size, q.shape[2], k.shape[2])
    tile = _tile(block_size)
    options = {"BLOCK_M": tile, "BLOCK_N": tile}
    return _compiled()(q, k, v, block_mask=mask, scale=scale, kernel_options=options)


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> bool:
    """Contiguous CUDA q, k, v of one kernel dtype, non-empty, a power-of-two head size of at
    least 16 and blocks a multiple of 16 (flex_attention's tiles)."""
    if not _checks.ready(q, k, v, device_type="cuda") or kv_block_index.device != q.device:
        return False
    try:
        op.check_meta(q, k, v, kv_block_index, kv_block_count, block_size, scale)
    except (TypeError, ValueError):
        return False
    d = q.shape[-1]
    return (
        q.shape[2] > 0 and k.shape[2] > 0 and d >= 16 and d & (d - 1) == 0 and block_size % 16 == 0
    )


KERNELS = {"block_sparse_attention": (block_sparse_attention, supports)}
