"""Child processes behind mccl's benchmarks: ``python -m mccl._startup startup|guard ...``.

``startup``: rank 0 measures the time from its start (after imports) to its first completed
all_reduce, building a model of ``--layers`` Linear(2048, 2048) layers on the way; rank 1 is a
late peer that joins ``--late`` seconds after it starts. ``guard``: one rank, the cost of
``dist.get_world_size()`` (a read of the default group) after a sync or an async init.
Each rank prints one JSON line (the late peer's is empty).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist

HIDDEN = 2048


def _init(mode: str, rank: int, world: int, port: int) -> object:
    options = {"init_method": f"tcp://127.0.0.1:{port}", "rank": rank, "world_size": world}
    if mode == "async":
        import mccl

        return mccl.init_process_group_async("gloo", **options)
    dist.init_process_group("gloo", **options)
    return None


def startup(args: argparse.Namespace) -> dict[str, float]:
    start = time.perf_counter()
    if args.rank != 0:
        time.sleep(args.late)
        _init("sync", args.rank, 2, args.port)
        dist.all_reduce(torch.ones(1))
        dist.destroy_process_group()
        return {}
    _init(args.mode, 0, 2, args.port)
    built = time.perf_counter()
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(args.layers)])
    setup_s = time.perf_counter() - built
    total = torch.ones(1) * sum(p.numel() for p in model.parameters())
    dist.all_reduce(total)
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    return {"seconds": seconds, "setup_s": setup_s}


def guard(args: argparse.Namespace) -> dict[str, float]:
    handle = _init(args.mode, 0, 1, args.port)
    if handle is not None:
        handle.wait()
    dist.get_world_size()
    start = time.perf_counter()
    for _ in range(args.calls):
        dist.get_world_size()
    seconds = (time.perf_counter() - start) / args.calls
    dist.destroy_process_group()
    return {"seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["startup", "guard"])
    parser.add_argument("--mode", choices=["sync", "async"], required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--late", type=float, default=0.6)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args(argv)
    print(json.dumps(startup(args) if args.what == "startup" else guard(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
