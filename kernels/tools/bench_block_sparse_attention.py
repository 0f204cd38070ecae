"""Time ``torch.ops.spore.block_sparse_attention`` against dense SDPA, side by side in one process.

    python kernels/tools/bench_block_sparse_attention.py --seq 4096 --heads 4 --dim 64 \\
        --block 64 --keep 0.25 --repeat 5

Every query block keeps the same number of distinct random KV blocks. Baselines, each timed
once per repeat in turn with the op (interleaved), median over the repeats:

- ``sdpa``: dense ``F.scaled_dot_product_attention`` (full attention, what runs without
  sparsity);
- ``sdpa+mask``: SDPA under the block lists' dense bool mask (the op's result, computed densely);
- ``reference``: the op's plain-torch reference (gathers the listed blocks).

Each cell is baseline time / op time (> 1: the op is faster). The op's output is checked against
``sdpa+mask`` before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import spore_kernels  # noqa: F401  (defines torch.ops.spore.*)
from spore_kernels.ops import block_sparse_attention as op

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.dim)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for _ in range(3))
    n = op.blocks(args.seq, args.block)
    keep = max(1, round(args.keep * n))
    index = torch.rand(args.batch, args.heads, n, n, generator=g).argsort(-1)[..., :keep]
    count = torch.full((args.batch, args.heads, n), keep)
    return q, k, v, index.to(torch.int32).contiguous(), count.to(torch.int32)


def _time_ms(fn: Callable[[], object], times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)


def _row(tag: str, args: argparse.Namespace) -> str:
    q, k, v, index, count = _inputs(args, DTYPES[tag])
    bs = args.block
    mask = op.dense_mask(index, count, bs, args.seq, args.seq)
    sides: dict[str, Callable[[], object]] = {
        "op": lambda: torch.ops.spore.block_sparse_attention(q, k, v, index, count, bs),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
        "sdpa+mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "reference": lambda: op.reference(q, k, v, index, count, bs),
    }
    tol = 1e-4 if tag == "fp32" else 2e-2
    torch.testing.assert_close(
        sides["op"]().float(), sides["sdpa+mask"]().float(), rtol=tol, atol=tol
    )
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeat):
        for name, fn in sides.items():
            _time_ms(fn, times[name])
    med = {name: statistics.median(t) for name, t in times.items()}
    ratios = " | ".join(
        f"{med[name] / med['op']:.2f}x ({med[name]:.1f} ms)" for name in list(sides)[1:]
    )
    return f"| {tag} | {med['op']:.1f} ms | {ratios} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--keep", type=float, default=0.25, help="fraction of KV blocks kept")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"B={args.batch} H={args.heads} S={args.seq} D={args.dim} block={args.block} "
        f"keep={args.keep} threads={args.threads} torch {torch.__version__}, median of "
        f"{args.repeat} interleaved repeats"
    )
    print("| dtype | op | vs sdpa | vs sdpa+mask | vs reference |")
    print("|---|---|---|---|---|")
    for tag in args.dtypes.split(","):
        print(_row(tag, args))


if __name__ == "__main__":
    main()
