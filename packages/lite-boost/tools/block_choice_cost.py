"""Time and memory of sparse attention's block choice (pooling, scores, top-k) alone.

    python packages/lite-boost/tools/block_choice_cost.py --shape 1,40,32760,128 --dtype bf16

Prints the median time of ``select_blocks`` over the repeats and the largest tensor any op in
it allocates (aliases of its arguments not counted), for reordered queries and keys of that shape.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lite_boost.sparse import select_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class LargestAlloc(TorchDispatchMode):
    """The largest new tensor (bytes; an alias of an argument not counted) any op returns
    while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1,40,32760,128", help="B,H,S,D of q and k")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    b, h, s, d = (int(n) for n in args.shape.split(","))
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, s, d, generator=g).to(DTYPES[args.dtype]) for _ in range(2))
    opts = {
        "video_len": s,
        "first_frame_len": 0,
        "text_first": False,
        "sparsity": 0.75,
        "block_size": args.block_size,
    }
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        select_blocks(q, k, **opts)
        times.append(time.perf_counter() - t0)
    with LargestAlloc() as seen:
        select_blocks(q, k, **opts)
    print(
        f"select_blocks {args.dtype} {tuple(q.shape)} blocks of {args.block_size}: "
        f"{statistics.median(times) * 1e3:.1f} ms (median of {args.repeat}), "
        f"largest allocation {seen.largest / 2**20:.1f} MiB (q alone: "
        f"{q.numel() * q.element_size() / 2**20:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
