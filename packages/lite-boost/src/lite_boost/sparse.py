"""Block-sparse attention for video tokens (RainFusion-style): each query block attends only to
the key blocks most relevant to it.

1. The video tokens, laid out (frame, row, column), are reordered tile by tile (tiles of
   ``tile_shape(...)``), so that each run of ``block_size`` tokens is a compact spatial tile of
   one frame where the frame is a whole number of tiles; edge tiles are smaller otherwise, and
   blocks then straddle tiles and frames. Text tokens stay together before or after the video.
2. Each block is pooled to the mean of its queries and of its keys; a query block's score for a
   key block is the pooled dot product. It keeps ``ceil((1 - sparsity) * blocks)`` key blocks:
   always its own block, the text blocks and the blocks of the first frame, then the best
   scoring others (when the forced blocks alone exceed that budget, it keeps just them); text
   query blocks attend to every block.
3. ``torch.ops.spore.block_sparse_attention`` computes the exact softmax over the kept blocks;
   the output is put back in the original token order.

``sparsity=0`` is dense attention exactly (:func:`lite_boost.backends.attention`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

import spore_kernels  # noqa: F401  (defines torch.ops.spore.block_sparse_attention)
from lite_boost import backends
from lite_boost.numeric_args import as_ints, as_written, int_at_least, is_number


def tile_shape(height: int, width: int, block_size: int) -> tuple[int, int]:
    """The (rows, columns) of a spatial tile holding about ``block_size`` tokens: as square as
    the block allows, never larger than the frame."""
    rows = min(height, 2 ** (int(math.log2(block_size)) // 2))
    cols = min(width, max(1, block_size // rows))
    return rows, cols


@functools.lru_cache(maxsize=32)
def reorder(latent_shape: tuple[int, int, int], block_size: int) -> torch.Tensor:
    """The permutation taking (frame, row, column) token order to tile order: position ``i`` of
    the reordered sequence holds token ``reorder(...)[i]``."""
    frames, height, width = latent_shape
    rows, cols = tile_shape(height, width, block_size)
    f, r, c = torch.meshgrid(
        torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"
    )
    tiles_across = -(-width // cols)
    key = (f * (-(-height // rows)) + r // rows) * tiles_across + c // cols
    token = (f * height + r) * width + c
    # within a tile, row-major; tiles in row-major order within each frame
    order = torch.argsort(key.flatten() * (rows * cols) + (r % rows * cols + c % cols).flatten())
    return token.flatten()[order]


def _latent(shape: Any) -> tuple[int, ...]:
    """``shape``'s sizes as ints (see :func:`lite_boost.numeric_args.as_int`)."""
    sizes = as_ints(shape)
    if sizes is None:
        raise ValueError(f"latent_shape must be three ints (frames, height, width), got {shape!r}")
    return sizes


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    latent_shape: tuple[int, int, int],
    text_len: int,
    sparsity: float,
) -> None:
    backends.check_qkv(q, k, v)
    if v.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"sparse attention takes v of q's head_dim {q.shape[-1]}, got v {tuple(v.shape)}; "
            f"lite_boost.attention takes another"
        )
    if len(latent_shape) != 3 or min(latent_shape) < 1:
        raise ValueError(f"latent_shape must be (frames, height, width) >= 1, got {latent_shape}")
    video = math.prod(latent_shape)
    if q.shape[2] != video + text_len or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"q and k must hold {video} video tokens {tuple(latent_shape)} + {text_len} text "
            f"tokens = {video + text_len}, got {q.shape[2]} and {k.shape[2]} (self-attention)"
        )
    if not is_number(sparsity):
        raise ValueError(
            f"sparsity must be a number in [0, 1), got {type(sparsity).__name__} {sparsity!r}"
        )
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")


def _pool(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Each block's mean (the last block ragged), fp32: (B, H, blocks, D). Pooled one head at a
    time: an fp32 copy of a whole bf16 ``x`` would take twice its memory. No gradient: the
    pooled scores only choose blocks."""
    x = x.detach()
    b, h, s, d = x.shape
    blocks = -(-s // block_size)
    padded = torch.zeros(b, blocks * block_size, d, dtype=torch.float32, device=x.device)
    sums = torch.empty(h, b, blocks, d, dtype=torch.float32, device=x.device)
    for i in range(h):
        padded[:, :s] = x[:, i]
        torch.sum(padded.view(b, blocks, block_size, d), 2, out=sums[i])
    sizes = torch.full((blocks,), float(block_size), device=x.device)
    sizes[-1] = s - (blocks - 1) * block_size
    return sums.transpose(0, 1) / sizes[:, None]


def keep_count(sparsity: float, blocks: int) -> int:
    """``ceil((1 - sparsity) * blocks)``, at least 1: the product rounded to 9 decimals first,
    so float error cannot keep one more block (``(1 - 0.7) * 10`` is ``3.0000000000000004``).
    A numpy float16 or float32 ``sparsity`` counts as the decimal it was written as
    (:func:`lite_boost.numeric_args.as_written`: ``np.float32(0.7)`` keeps what ``0.7`` keeps,
    not what its binary value 0.699999988 would); the count is computed in Python floats."""
    return max(1, math.ceil(round((1.0 - float(as_written(sparsity))) * blocks, 9)))


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    video_len: int,
    first_frame_len: int,
    text_first: bool,
    sparsity: float,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept key blocks of each query block of reordered ``q``/``k`` (B, H, S, D):
    ``(kv_block_index, kv_block_count)`` as ``torch.ops.spore.block_sparse_attention`` takes
    them (int64; (B, H, blocks, blocks) and (B, H, blocks))."""
    s = q.shape[2]
    block_size = min(block_size, max(s, 1))  # a longer block is the one block there is
    blocks = -(-s // block_size)
    scores = _pool(q, block_size) @ _pool(k, block_size).transpose(-1, -2)
    start = s - video_len if text_first else 0  # where the video tokens begin
    ids = torch.arange(blocks, device=q.device)
    first, last = ids * block_size, torch.clamp((ids + 1) * block_size, max=s) - 1
    text = (first < start) | (last >= start + video_len)  # blocks holding text tokens
    first_frame = (first < start + first_frame_len) & (last >= start)
    forced = text | first_frame
    # a NaN score (a NaN token) ranks last: argsort puts NaN above the forced blocks' inf
    scores = scores.nan_to_num(nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    scores = scores.masked_fill(forced, math.inf)
    scores.diagonal(dim1=-2, dim2=-1).fill_(math.inf)  # a query block keeps its own block
    keep = keep_count(sparsity, blocks)
    index = scores.argsort(dim=-1, descending=True)
    n_forced = (scores == math.inf).sum(-1)
    count = torch.clamp(n_forced, min=keep)
    count = torch.where(text[None, None, :], torch.full_like(count, blocks), count)
    return index, count


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_block_index: torch.Tensor,
    kv_block_count: torch.Tensor,
    block_size: int,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Each query block of each (batch, head) attends only to its listed key blocks:
    ``torch.ops.spore.block_sparse_attention`` (see spore-kernels for the layout)."""
    return torch.ops.spore.block_sparse_attention(
        q, k, v, kv_block_index, kv_block_count, block_size, scale
    )


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    latent_shape: tuple[int, int, int],
    text_len: int = 0,
    sparsity: float,
    block_size: int = 128,
    text_first: bool = False,
) -> torch.Tensor:
    """Self-attention of (B, H, S, D) tokens — ``latent_shape`` (frames, height, width) video
    tokens in (frame, row, column) order, plus ``text_len`` text tokens after them (before
    them with ``text_first``) — skipping the key blocks a query block needs least. Under
    autocast, q, k and v are cast first as the attention op casts them
    (:func:`lite_boost.backends.autocast_qkv`)."""
    latent_shape = _latent(latent_shape)
    text_len = int_at_least(text_len, "text_len", 0)
    block_size = int_at_least(block_size, "block_size", 1)
    q, k, v = backends.autocast_qkv(q, k, v)  # as the attention op's autocast kernel casts them
    _check(q, k, v, latent_shape, text_len, sparsity)
    block_size = min(block_size, max(q.shape[2], 1))  # one block, in memory of the sequence's
    if sparsity == 0.0:
        return backends.attention(q, k, v)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    video = math.prod(latent_shape)
    start = text_len if text_first else 0
    perm = reorder(latent_shape, block_size).to(q.device) + start
    order = torch.cat(
        [
            torch.arange(0, start, device=q.device),
            perm,
            torch.arange(start + video, q.shape[2], device=q.device),
        ]
    )
    qr, kr, vr = (t.index_select(2, order) for t in (q, k, v))
    index, count = select_blocks(
        qr,
        kr,
        video_len=video,
        first_frame_len=latent_shape[1] * latent_shape[2],
        text_first=text_first,
        sparsity=sparsity,
        block_size=block_size,
    )
    out = block_sparse_attention(
        qr.contiguous(), kr.contiguous(), vr.contiguous(), index, count, block_size
    )
    restored = torch.empty_like(out)
    restored.index_copy_(2, order, out)
    return restored
