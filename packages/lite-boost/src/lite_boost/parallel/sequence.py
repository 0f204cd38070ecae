"""Split a tensor along one dimension over the ranks of a group and gather it back.

Chunks are contiguous and as even as possible (the first ``n % world`` ranks hold one element
more). :func:`gather_sequence` takes any per-rank lengths, including zero: every rank first
shares its shape and dtype (so a mismatch is a clear error on every rank instead of a hang),
then the chunks are padded to the longest for one ``all_gather`` and unpadded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lite_boost.parallel.manager import ParallelManager

MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


def split_sizes(n: int, world: int) -> list[int]:
    """Lengths of ``world`` contiguous chunks of ``n`` elements, the first ``n % world`` longer."""
    return [n // world + (r < n % world) for r in range(world)]


def shard_sequence(x: torch.Tensor, dim: int, manager: ParallelManager) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (a view; no communication)."""
    dim = _dim(x, dim)
    sizes = split_sizes(x.shape[dim], manager.world)
    return x.narrow(dim, sum(sizes[: manager.rank]), sizes[manager.rank])


def gather_sequence(x_local: torch.Tensor, dim: int, manager: ParallelManager) -> torch.Tensor:
    """Concatenate every rank's ``x_local`` along ``dim``, in rank order, on every rank.

    Lengths along ``dim`` may differ by rank (zero too); every other dimension and the dtype
    must agree, else every rank raises ``ValueError``. Not differentiable.
    """
    dim = _dim(x_local, dim)
    shapes = exchange_shapes(x_local, manager)
    for r, (dtype, shape) in enumerate(shapes):
        same_rest = len(shape) == x_local.dim() and all(
            a == b for i, (a, b) in enumerate(zip(shape, x_local.shape, strict=True)) if i != dim
        )
        if dtype != x_local.dtype or not same_rest:
            raise ValueError(
                f"gather_sequence along dim {dim}: rank {r} holds a {dtype} tensor of shape "
                f"{shape}, rank {manager.rank} a {x_local.dtype} tensor of shape "
                f"{tuple(x_local.shape)}; all dims but {dim} and the dtype must agree"
            )
    lengths = [shape[dim] for _, shape in shapes]
    if manager.world == 1:
        return x_local
    longest = max(lengths)
    if longest == 0:
        return x_local
    padded = x_local.new_zeros(*x_local.shape[:dim], longest, *x_local.shape[dim + 1 :])
    padded.narrow(dim, 0, lengths[manager.rank]).copy_(x_local)
    parts = [torch.empty_like(padded) for _ in range(manager.world)]
    dist.all_gather(parts, padded, group=manager.group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, lengths, strict=True)], dim=dim)


def exchange_shapes(
    x: torch.Tensor | None,
    manager: ParallelManager,
    *,
    device: torch.device | None = None,
    failed: bool = False,
) -> list[tuple[torch.dtype | None, tuple[int, ...] | None]]:
    """Every rank's ``(dtype, shape)``, in rank order: ``(None, ())`` from a rank that passed
    ``None``, ``(None, None)`` from one that passed ``failed=True`` (so the others can raise
    instead of waiting for it). One ``all_gather`` of a small int64 tensor on ``x``'s device
    (or ``device``)."""
    if x is not None and x.dim() > MAX_DIMS:
        raise ValueError(f"at most {MAX_DIMS} dimensions are supported, got {x.dim()}")
    header = torch.full((2 + MAX_DIMS,), -1, dtype=torch.int64)
    if failed:
        header[0] = -2
    elif x is not None:
        header[0] = x.dim()
        header[1] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
        header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    header = header.to(x.device if x is not None else device or "cpu")
    if manager.world == 1:
        headers = [header]
    else:
        headers = [torch.empty_like(header) for _ in range(manager.world)]
        dist.all_gather(headers, header, group=manager.group)
    shapes = []
    for h in (t.tolist() for t in headers):
        if h[0] < 0:
            shapes.append((None, () if h[0] == -1 else None))
            continue
        if h[1] >= len(_DTYPES):
            raise TypeError(f"a rank holds a tensor of a dtype this exchange lacks; use {_DTYPES}")
        shapes.append((_DTYPES[h[1]], tuple(h[2 : 2 + h[0]])))
    return shapes


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a {x.dim()}-d tensor")
    return dim % x.dim()
