"""``spore bench lite-boost``: sparse against dense attention on video-shaped sequences.

- ``sparse-<sparsity>-<dtype>``: :func:`lite_boost.sparse.sparse_attention` against dense SDPA
  (:func:`lite_boost.backends.attention`) on the same (batch, heads, tokens, head_dim) inputs:
  a Wan-style 21x30x52 latent scaled to CPU as 4x24x32 video tokens, 4 heads of 64, blocks of
  64. Inputs vary smoothly over the (frame, row, column) grid, as video tokens do; each sample
  also reports the output's cosine similarity to dense attention (``cosine``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from spore.bench import Benchmark

LATENT = (4, 24, 32)
HEADS, HEAD_DIM, BLOCK = 4, 64, 64
SAMPLE_S = 0.2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def video_tokens(latent: tuple[int, int, int], dtype: torch.dtype, seed: int = 0) -> list:
    """q, k, v of one video: features smooth over the grid plus a little noise."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = latent
    grid = torch.stack(
        torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1
    )
    grid = grid.reshape(-1, 3).float()
    out = []
    for _ in range(3):
        freqs = torch.randn(HEADS, 3, HEAD_DIM, generator=g) * 0.3
        base = torch.sin(torch.einsum("sc,hcd->hsd", grid, freqs)) * 2
        noise = torch.randn(HEADS, grid.shape[0], HEAD_DIM, generator=g) * 0.1
        out.append((base + noise)[None].to(dtype).contiguous())
    return out


def _timed(fn: Callable[[], torch.Tensor], reference: torch.Tensor) -> dict[str, float]:
    out = fn()
    spent, count = 0.0, 0
    while spent < SAMPLE_S:
        start = time.perf_counter()
        fn()
        spent += time.perf_counter() - start
        count += 1
    cosine = torch.nn.functional.cosine_similarity(
        out.float().flatten(), reference.float().flatten(), dim=0
    )
    return {"seconds": spent / count, "cosine": float(cosine)}


def _sparse_case(sparsity: float, dtype_name: str) -> Benchmark:
    from lite_boost import backends
    from lite_boost.sparse import sparse_attention

    def setup() -> Any:
        q, k, v = video_tokens(LATENT, DTYPES[dtype_name])
        return q, k, v, backends.attention(q, k, v)

    def dense(state: Any) -> dict[str, float]:
        q, k, v, ref = state
        return _timed(lambda: backends.attention(q, k, v), ref)

    def sparse(state: Any) -> dict[str, float]:
        q, k, v, ref = state
        run = lambda: sparse_attention(  # noqa: E731
            q, k, v, latent_shape=LATENT, sparsity=sparsity, block_size=BLOCK
        )
        return _timed(run, ref)

    tokens = math.prod(LATENT)
    return Benchmark(
        name=f"sparse-{int(sparsity * 100)}-{dtype_name}",
        baseline=dense,
        candidate=sparse,
        baseline_label=f"dense SDPA, {tokens} video tokens {LATENT}, {HEADS}x{HEAD_DIM} heads",
        candidate_label=f"lite_boost.sparse_attention, sparsity {sparsity}, blocks of {BLOCK}",
        setup=setup,
        description="sparse vs dense self-attention on a video-shaped sequence (cosine: output "
        "similarity to dense)",
        self_timed=True,
    )


def benchmarks() -> list[Benchmark]:
    """Every lite-boost case."""
    return [_sparse_case(s, d) for s in (0.0, 0.5, 0.75) for d in DTYPES]
