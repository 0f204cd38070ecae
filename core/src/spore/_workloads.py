"""Allocator-sensitive eager workloads, run in a child process: ``python -m spore._workloads``.

Each prints one JSON line: median seconds per iteration, peak RSS and page faults per
iteration. Used by the core's allocator benchmarks and by ``spore doctor``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable

from spore import childproc

ROWS, HIDDEN = 8192, 4096  # 8192 x 4096 fp32: 128 MiB per tensor


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rmsnorm() -> Callable[[], object]:
    import torch

    x, w = torch.randn(ROWS, HIDDEN), torch.randn(HIDDEN)
    return lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _mlp_block() -> object:
    """LayerNorm + Linear(256, 2048) + GELU + Linear(2048, 256): on 8192 tokens the 8192 x 2048
    activations are 64 MiB each."""
    import torch

    return torch.nn.Sequential(
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 256),
    )


def _mlp() -> Callable[[], object]:
    import torch

    block = _mlp_block()
    x = torch.randn(8192, 256, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    return step


def _fresh() -> Callable[[], object]:
    import torch

    x = torch.randn(ROWS, HIDDEN)
    return lambda: torch.empty_like(x).copy_(x)


def _reused() -> Callable[[], object]:
    import torch

    x = torch.randn(ROWS, HIDDEN)
    out = torch.empty_like(x)
    return lambda: out.copy_(x)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def saved_rss(offload: bool) -> dict[str, float]:
    """One MLP-block step: resident memory when backward starts, with or without offload."""
    import torch

    from spore import memory

    torch.manual_seed(0)
    block = _mlp_block()
    x = torch.randn(8192, 256, requires_grad=True)
    seen: dict[str, float] = {}
    base = _rss_mib()
    start = time.perf_counter()
    if offload:
        with memory.offload("disk", min_bytes=1 << 20) as stats:
            out = block(x)
    else:
        out = block(x)
    out.register_hook(lambda grad: seen.update(rss=_rss_mib()))
    out.sum().backward()
    grad = x.grad
    return {
        "seconds": time.perf_counter() - start,
        "rss_at_backward_mib": seen["rss"] - base,
        "offloaded_mib": stats.offloaded_bytes / 2**20 if offload else 0.0,
        "grad_checksum": float(grad.double().abs().sum()),
    }


WORKLOADS: dict[str, Callable[[], Callable[[], object]]] = {
    "rmsnorm": _rmsnorm,
    "mlp": _mlp,
    "fresh": _fresh,
    "reused": _reused,
}


def measure(name: str, iters: int, warmup: int = 12) -> dict[str, float]:
    """Median seconds per call of workload ``name`` after ``warmup`` calls."""
    import torch

    torch.manual_seed(0)
    step = WORKLOADS[name]()
    for _ in range(warmup):
        step()
    times = []
    faults = _faults()
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "faults_per_iter": (_faults() - faults) / iters,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_workload(workload: str, env: dict[str, str], iters: int = 5) -> dict[str, float]:
    """Run ``workload`` in a child process with environment ``env``; its JSON figures."""
    command = childproc.python("-m", "spore._workloads", workload, "--iters", str(iters))
    return childproc.run_json(command, env=env, timeout=600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=sorted([*WORKLOADS, "saved-rss", "saved-rss-offload"]))
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    if args.workload.startswith("saved-rss"):
        print(json.dumps(saved_rss(offload=args.workload.endswith("offload"))))
    else:
        print(json.dumps(measure(args.workload, args.iters)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
