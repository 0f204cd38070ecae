"""``spore bench lite-boost``: sparse against dense attention on video-shaped sequences.

- ``sparse-<sparsity>-<dtype>``: :func:`lite_boost.sparse.sparse_attention` against dense SDPA
  (:func:`lite_boost.backends.attention`) on the same (batch, heads, tokens, head_dim) inputs:
  a Wan-style 21x30x52 latent scaled to CPU as 16x12x16 = 3072 video tokens (the first frame
  about the same share of the tokens, 6 %), 4 heads of 64, blocks of 64. Queries and keys vary
  smoothly over the (frame, row, column) grid and alike, so attention is mostly local, as in
  video models; each sample also reports the output's cosine similarity to dense attention
  (``cosine``).
- ``rope-<dtype>``: :mod:`lite_boost.rope3d` (cached fp32 tables through ``spore.rope``)
  against the original Wan path, which builds float64 angles each forward and rotates the
  channel pairs as complex128 numbers; a 21x15x26 token grid, 4 heads of 128.
- ``wan-step-<sparsity>``: one denoising step (a forward of diffusers' WanTransformer3DModel,
  small random-weight config, 4x32x32 latent video = 1024 tokens, 4 heads of 32, 2 layers)
  boosted by :func:`lite_boost.boost` against the same model unboosted; ``cosine`` compares
  the boosted step's output with the unboosted one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch

from spore.bench import Benchmark

LATENT = (16, 12, 16)
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

    def waves() -> torch.Tensor:
        freqs = torch.randn(HEADS, 3, HEAD_DIM, generator=g) * 0.3
        return torch.sin(torch.einsum("sc,hcd->hsd", grid, freqs)) * 2

    shared = waves()  # queries and keys alike where tokens are near: attention is local
    out = []
    for base in (shared, shared, waves()):
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


ROPE_GRID, ROPE_HEADS, ROPE_DIM = (21, 15, 26), 4, 128


def _complex_rope(x: torch.Tensor, grid: tuple[int, int, int], head_dim: int) -> torch.Tensor:
    """The original Wan rotation: float64 angles built per call, pairs as complex128."""
    from lite_boost import rope3d

    angles = rope3d._angles(grid, head_dim, 10000.0)
    turn = torch.polar(torch.ones_like(angles), angles)[None, :, None]
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def _rope_case(dtype_name: str) -> Benchmark:
    from lite_boost import rope3d

    def setup() -> Any:
        g = torch.Generator().manual_seed(0)
        tokens = math.prod(ROPE_GRID)
        x = torch.randn(1, tokens, ROPE_HEADS, ROPE_DIM, generator=g).to(DTYPES[dtype_name])
        return x, _complex_rope(x, ROPE_GRID, ROPE_DIM)

    def original(state: Any) -> dict[str, float]:
        x, ref = state
        return _timed(lambda: _complex_rope(x, ROPE_GRID, ROPE_DIM), ref)

    def cached(state: Any) -> dict[str, float]:
        x, ref = state

        def run() -> torch.Tensor:
            cos, sin = rope3d.rope_tables(ROPE_GRID, ROPE_DIM)
            return rope3d.apply_rope(x, cos, sin, seq_dim=1)

        return _timed(run, ref)

    return Benchmark(
        name=f"rope-{dtype_name}",
        baseline=original,
        candidate=cached,
        baseline_label=f"float64 complex RoPE (Wan's own), grid {ROPE_GRID}, "
        f"{ROPE_HEADS}x{ROPE_DIM} heads",
        candidate_label="lite_boost.rope3d: cached fp32 tables + spore.rope",
        setup=setup,
        description="3-D RoPE applied to one (batch, tokens, heads, head_dim) query",
        self_timed=True,
    )


WAN_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 64,
    "freq_dim": 64,
    "ffn_dim": 256,
    "num_layers": 2,
    "rope_max_seq_len": 64,
}
WAN_LATENT = (4, 32, 32)


def _wan_case(sparsity: float) -> Benchmark:
    def setup() -> Any:
        import copy

        from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

        from lite_boost.boosters import boost

        torch.manual_seed(0)
        plain = WanTransformer3DModel(**WAN_CONFIG).eval()
        boosted = boost(copy.deepcopy(plain), sparsity=sparsity, block_size=BLOCK)
        f, h, w = WAN_LATENT
        t, y, x = torch.meshgrid(
            torch.linspace(0, 1, f), torch.linspace(0, 1, h), torch.linspace(0, 1, w),
            indexing="ij",
        )  # fmt: skip
        g = torch.Generator().manual_seed(1)
        phase = torch.rand(WAN_CONFIG["in_channels"], 3, generator=g) * 6.28
        latents = (
            torch.sin(6.28 * x + phase[:, 0, None, None, None])
            + torch.cos(6.28 * y + phase[:, 1, None, None, None])
            + 0.5 * torch.sin(3.14 * t + phase[:, 2, None, None, None])
        )[None]
        text = torch.randn(1, 32, WAN_CONFIG["text_dim"], generator=g)
        args = (latents, torch.tensor([500]), text)
        with torch.no_grad():
            ref = plain(*args, return_dict=False)[0]
        return plain, boosted, args, ref

    def step(model: torch.nn.Module, args: tuple, ref: torch.Tensor) -> dict[str, float]:
        with torch.no_grad():
            return _timed(lambda: model(*args, return_dict=False)[0], ref)

    return Benchmark(
        name=f"wan-step-{int(sparsity * 100)}",
        baseline=lambda s: step(s[0], s[2], s[3]),
        candidate=lambda s: step(s[1], s[2], s[3]),
        baseline_label="diffusers WanTransformer3DModel forward (small config, 1024 tokens)",
        candidate_label=f"lite_boost.boost(model, sparsity={sparsity}, block_size={BLOCK})",
        setup=setup,
        description="one denoising step of a small Wan transformer, fp32",
        self_timed=True,
    )


def benchmarks() -> list[Benchmark]:
    """Every lite-boost case."""
    cases = [_sparse_case(s, d) for s in (0.0, 0.5, 0.75) for d in DTYPES]
    cases += [_rope_case(d) for d in DTYPES]
    cases += [_wan_case(s) for s in (0.0, 0.75)]
    return cases
