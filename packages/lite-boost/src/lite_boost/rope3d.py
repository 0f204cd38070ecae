"""3-D rotary position embedding for (frames, rows, columns) video token grids, as Wan uses it.

A head of ``head_dim`` channels is split the way diffusers' ``WanRotaryPosEmbed`` splits it:
``2 * (head_dim // 6)`` channels each for the row and the column positions, the rest (first)
for the frame position. Channels pair up as ``(2i, 2i + 1)`` (interleaved, complex-style) and
each pair turns by ``position * theta ** (-2j / axis_dim)``, ``j`` the pair's index within its
axis.

:func:`rope_tables` returns the ``(cos, sin)`` tables of a grid, one angle per pair:
``(f * h * w, head_dim // 2)``, tokens in (frame, row, column) order. The angles and their
cosines and sines are evaluated in float64 on the CPU at a cache miss (as diffusers builds its
own tables) and stored rounded once to ``dtype`` (float32 by default) on ``device``; later calls
for the same key return the cached tensors (shared: do not modify them). The cache is a bounded
LRU of :data:`CACHE_SIZE` entries keyed by (grid, head_dim, device, dtype, theta); a 21x30x52
grid at head_dim 128 is about 17 MB of float32 tables. Under ``torch.compile`` the tables are
computed in the graph instead (the same float64 evaluation; no cache, no lock to trace), so a
boosted model compiles with ``fullgraph=True``.

:func:`apply_rope` rotates ``x`` with such tables through ``torch.ops.spore.rope`` in its
``"interleaved"`` mode (computed in float32, rounded once to ``x``'s dtype), so no permutation
of the channels is needed.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import NamedTuple

import torch

import spore_kernels  # noqa: F401  (defines torch.ops.spore.rope)
from lite_boost.numeric_args import as_int, as_ints, as_real

CACHE_SIZE = 8
"""Most (grid, head_dim, device, dtype, theta) table pairs kept; the least recently used goes."""

_Key = tuple[tuple[int, int, int], int, str, torch.dtype, float]


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int


class _Cache:
    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.lock = threading.Lock()
        self.entries: OrderedDict[_Key, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0


_cache = _Cache(CACHE_SIZE)


def cache_info() -> CacheInfo:
    """Hits, misses and size of the table cache since the last :func:`cache_clear`."""
    with _cache.lock:
        return CacheInfo(_cache.hits, _cache.misses, len(_cache.entries), _cache.maxsize)


def cache_clear() -> None:
    """Drop every cached table and reset the counters."""
    with _cache.lock:
        _cache.entries.clear()
        _cache.hits = _cache.misses = 0


def _head_dim(head_dim: int) -> int:
    """``head_dim`` as an int (numpy or 0-d tensor integers taken, see
    :func:`lite_boost.numeric_args.as_int`), even and at least 6."""
    n = as_int(head_dim)
    if n is None:
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if n < 6 or n % 2:
        raise ValueError(
            f"3-D RoPE splits head_dim into even frame/row/column parts (rows and columns get "
            f"2 * (head_dim // 6) channels each): head_dim must be even and at least 6, "
            f"got {n}"
        )
    return n


def split(head_dim: int) -> tuple[int, int, int]:
    """The (frame, row, column) channel counts of a head, as Wan splits it."""
    n = _head_dim(head_dim)
    spatial = 2 * (n // 6)
    return n - 2 * spatial, spatial, spatial


def _grid(grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """``grid``'s sizes as ints (see :func:`lite_boost.numeric_args.as_ints`), three positive
    ones."""
    sizes = as_ints(grid)
    if sizes is None or len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(
            f"grid must be three positive ints (frames, height, width) of latent tokens, "
            f"got {grid!r}"
        )
    return sizes  # type: ignore[return-value]


def _device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _angles(grid: tuple[int, int, int], head_dim: int, theta: float) -> torch.Tensor:
    """(f * h * w, head_dim // 2) float64 angles, tokens in (frame, row, column) order."""
    parts = []
    for axis, (size, dim) in enumerate(zip(grid, split(head_dim), strict=True)):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angle = torch.arange(size, dtype=torch.float64)[:, None] * inv_freq
        shape = [1, 1, 1, dim // 2]
        shape[axis] = size
        parts.append(angle.view(shape).expand(*grid, dim // 2))
    return torch.cat(parts, dim=-1).reshape(-1, head_dim // 2)


def _tables(
    grid: tuple[int, int, int],
    head_dim: int,
    theta: float,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of :func:`_angles`, evaluated in float64, in ``dtype`` on ``device``."""
    angles = _angles(grid, head_dim, theta)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def rope_tables(
    grid: tuple[int, int, int],
    head_dim: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    theta: float = 10000.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(f * h * w, head_dim // 2)`` in ``dtype`` on ``device``, for the
    token grid ``grid = (f, h, w)``; cached (see the module docstring). ``theta`` is a positive
    finite real number (numpy's or a 0-d tensor's too, see
    :func:`lite_boost.numeric_args.as_real`)."""
    sizes = _grid(grid)
    head_dim = _head_dim(head_dim)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    base = as_real(theta)
    if base is None or not 0 < base < math.inf:
        raise ValueError(f"theta must be a positive finite number, got {theta!r}")
    dev = _device(device)
    if torch.compiler.is_compiling():  # dynamo cannot trace the cache's lock: made in the graph
        return _tables(sizes, head_dim, base, dev, dtype)
    key: _Key = (sizes, head_dim, str(dev), dtype, base)
    with _cache.lock:
        found = _cache.entries.get(key)
        if found is not None:
            _cache.entries.move_to_end(key)
            _cache.hits += 1
            return found
        _cache.misses += 1
    # made outside inference mode whatever the caller's: a cached inference tensor could never
    # again be saved for a backward (a validation step under inference_mode, then training)
    with torch.inference_mode(False):
        tables = _tables(sizes, head_dim, base, dev, dtype)
    with _cache.lock:
        tables = _cache.entries.setdefault(key, tables)
        _cache.entries.move_to_end(key)
        while len(_cache.entries) > _cache.maxsize:
            _cache.entries.popitem(last=False)
    return tables


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, seq_dim: int = -2
) -> torch.Tensor:
    """Rotate the interleaved channel pairs of ``x`` by the tables of :func:`rope_tables`.

    ``x``'s last dimension is the head (``head_dim`` channels) and ``seq_dim`` its token
    dimension: ``-2`` for ``(batch, heads, seq, head_dim)``, ``1`` for
    ``(batch, seq, heads, head_dim)``. Returns a new tensor in ``x``'s dtype.
    """
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must be (seq, head_dim // 2) tables from rope_tables, got shapes "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if not -x.dim() <= seq_dim < x.dim() or seq_dim % x.dim() == x.dim() - 1:
        raise ValueError(
            f"seq_dim {seq_dim} must name a dimension of x {tuple(x.shape)} before its last "
            f"(head_dim)"
        )
    seq_dim %= x.dim()
    seq, pairs = cos.shape
    if x.shape[seq_dim] != seq or x.shape[-1] != 2 * pairs:
        raise ValueError(
            f"x {tuple(x.shape)} does not fit tables for {seq} tokens of head_dim {2 * pairs}: "
            f"x.shape[{seq_dim}] must be {seq} and x.shape[-1] {2 * pairs}"
        )
    trailing = (1,) * (x.dim() - 2 - seq_dim)
    view = (seq, *trailing, pairs)
    return torch.ops.spore.rope(x, cos.view(view), sin.view(view), "interleaved")
