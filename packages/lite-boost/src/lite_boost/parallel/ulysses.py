"""Ulysses sequence parallel attention (DeepSpeed-Ulysses): each rank holds a slice of the
sequence with every head; one all-to-all gives each rank every position for ``heads / world``
heads, attention runs locally on the full sequence, a second all-to-all returns the output to
the sequence slices.

The exchange is ``torch.distributed.all_to_all_single`` (any backend that has it: gloo, nccl,
hccl) behind a small autograd function, so gradients flow back through the same exchange.
q, k and v travel in one collective.
Per-rank sequence lengths may differ: slices are padded to the longest for the collective and
the padding is dropped before attention, so the result is exactly attention over the
concatenated sequence.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from lite_boost.parallel.manager import ParallelManager


def ulysses_attention(
    attn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    manager: ParallelManager,
) -> torch.Tensor:
    """``attn`` over the whole sequence, each rank passing and getting back its own slice.

    ``q``, ``k``, ``v``: ``(batch, heads, seq_r, head_dim)``, this rank's sequence slice (the
    rank-order concatenation of the slices is the sequence; ``seq_r`` may differ by rank).
    ``k``/``v`` may have fewer heads than ``q`` (grouped queries) when both head counts are
    multiples of the world size. ``attn(q, k, v)`` gets ``(batch, heads / world, seq, head_dim)``
    (e.g. :func:`lite_boost.backends.attention`). Returns ``(batch, heads, seq_r, head_dim)``.
    """
    if not all(hasattr(manager, a) for a in ("group", "rank", "world")):
        raise TypeError(
            f"ulysses_attention needs manager=ParallelManager(...), got {type(manager).__name__}"
        )
    world = manager.world
    try:
        _check(q, k, v, world)
    except ValueError:
        if world > 1:  # the other ranks learn it from the exchange, rather than wait there
            _lengths(q, k, manager, refused=True)
        raise
    if world == 1:
        return attn(q, k, v)
    lengths = _lengths(q, k, manager)
    if max(lengths) == 0:
        return attn(q, k, v)
    batch, hq, _, dim = q.shape
    hk = k.shape[1]
    # (batch, world, heads per rank, seq_r, dim) for q, k, v, packed on the head axis
    packed = torch.cat(
        [t.reshape(batch, world, t.shape[1] // world, t.shape[2], dim) for t in (q, k, v)], dim=2
    )
    full = _seq_to_heads(packed, lengths, manager)
    q_full, k_full, v_full = full.split([hq // world, hk // world, hk // world], dim=1)
    out = attn(q_full, k_full, v_full)
    if out.dim() != 4 or out.shape[:3] != q_full.shape[:3]:
        raise ValueError(
            f"attn returned shape {tuple(out.shape)}; expected (batch, heads, seq, head_dim) "
            f"with leading dims {tuple(q_full.shape[:3])}"
        )
    return _heads_to_seq(out, lengths, manager)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "ulysses_attention takes (batch, heads, seq, head_dim) tensors, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must equal each other and match q "
            f"{tuple(q.shape)} in batch, sequence slice and head_dim"
        )
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError("q, k and v must share one dtype and one device")
    for name, heads in (("q", q.shape[1]), ("k/v", k.shape[1])):
        if heads % world:
            raise ValueError(
                f"Ulysses attention splits heads over ranks: {name} has {heads} heads, not a "
                f"multiple of the world size {world}; use a group whose size divides {heads}"
            )


_LAYOUT = ("batch", "q heads", "k/v heads", "head_dim", "dtype")


def _lengths(
    q: torch.Tensor, k: torch.Tensor, manager: ParallelManager, *, refused: bool = False
) -> list[int]:
    """Every rank's sequence length (dim 2), in rank order; a ``ValueError`` on every rank
    when the ranks disagree on anything else the exchange needs equal (in gloo such a
    mismatch aborts the process), or when a rank refused its own inputs (``refused``: this
    one did, and raises its own error after this exchange)."""
    if refused:
        mine = torch.full((1 + len(_LAYOUT),), -1, dtype=torch.int64, device=q.device)
    else:
        dtype = zlib.crc32(str(q.dtype).encode())  # the same on every rank, for any dtype
        layout = (q.shape[0], q.shape[1], k.shape[1], q.shape[3], dtype)
        mine = torch.tensor([q.shape[2], *layout], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(manager.world)]
    dist.all_gather(every, mine, group=manager.group)
    rows = [[int(n) for n in t.tolist()] for t in every]
    if refused:
        return []
    for r, row in enumerate(rows):
        if row[0] < 0:
            raise ValueError(
                f"Ulysses attention: rank {r} refused its q, k, v (its own error says why); "
                f"every rank must pass inputs it takes"
            )
        for name, theirs, ours in zip(_LAYOUT, row[1:], layout, strict=True):
            if theirs != ours:
                shapes = [f"rank {i}: {tuple(each[1:5])}" for i, each in enumerate(rows)]
                raise ValueError(
                    f"Ulysses attention needs every rank's q, k, v to agree on all but the "
                    f"sequence length: rank {r}'s {name} differs from rank {manager.rank}'s "
                    f"((batch, q heads, k/v heads, head_dim) {'; '.join(shapes)}; dtypes "
                    f"must match too)"
                )
    return [row[0] for row in rows]


class _Exchange(torch.autograd.Function):
    """All-to-all of equal blocks along dim 0; its adjoint is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _Exchange.apply(grad, ctx.group), None


def _exchange(x: torch.Tensor, manager: ParallelManager) -> torch.Tensor:
    """All-to-all along dim 0 (length ``world``): block ``r`` goes to rank ``r``, and block
    ``r`` of the result came from rank ``r``."""
    return _Exchange.apply(x, manager.group)


def _seq_to_heads(
    packed: torch.Tensor, lengths: list[int], manager: ParallelManager
) -> torch.Tensor:
    """``(batch, world, heads_r, seq_r, dim)`` -> ``(batch, heads_r, seq, dim)``."""
    pad = max(lengths) - packed.shape[3]
    if pad:
        packed = torch.nn.functional.pad(packed, (0, 0, 0, pad))
    got = _exchange(packed.transpose(0, 1), manager)  # (world, batch, heads_r, longest, dim)
    return torch.cat([got[r, :, :, :n] for r, n in enumerate(lengths)], dim=2)


def _heads_to_seq(out: torch.Tensor, lengths: list[int], manager: ParallelManager) -> torch.Tensor:
    """``(batch, heads_r, seq, dim)`` -> this rank's ``(batch, heads, seq_r, dim)``."""
    longest = max(lengths)
    slices = out.split(lengths, dim=2)
    blocks = torch.stack(
        [torch.nn.functional.pad(s, (0, 0, 0, longest - s.shape[2])) for s in slices]
    )
    got = _exchange(blocks, manager)  # (world, batch, heads_r, longest, dim): heads by rank
    mine = got[:, :, :, : lengths[manager.rank]]
    return mine.transpose(0, 1).flatten(1, 2)
