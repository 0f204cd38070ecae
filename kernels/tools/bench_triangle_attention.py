"""triangle_attention (the fused C++ kernel) against unfused composites, side by side.

Two composites: the op's reference without its checks (``ops.triangle_attention.composite``:
einsum, + bias, mask, softmax, einsum, in float32, rows with no key zeroed) and the leaner one
models write (``additive_mask_composite``: the mask added as a -1e9 bias, one softmax). All run
in one process on the same inputs at Pairformer shapes (q, k, v ``[1, N, N, H, D]``, bias
``[1, H, N, N]``, a bool mask ``[1, N, N]`` dropping 10 % of the keys), interleaved, forward
and forward+backward (gradients for q, k, v and bias, ones upstream). Each line gives the
median time of each side, each composite's ratio (composite / fused: > 1, the fused op is
faster) and the peak bytes of the tensors each side creates (``spore.memory.peak``; the C++
kernel's per-thread scratch is not a tensor and is not counted: see the README for its size).

    python kernels/tools/bench_triangle_attention.py --tokens 128 256 --repeat 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import spore_kernels  # noqa: F401  (defines torch.ops.spore.triangle_attention)
from spore import memory
from spore_kernels.ops import triangle_attention as op

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def inputs(n: int, heads: int, dim: int, dtype: torch.dtype, grad: bool) -> tuple[Any, ...]:
    args = op.bench_inputs(dtype, torch.Generator().manual_seed(n), n, heads, dim)
    if grad:
        return (*(t.requires_grad_() for t in args[:4]), args[4])
    return args


def fused(*args: Any) -> torch.Tensor:
    return torch.ops.spore.triangle_attention(*args)


def step(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], backward: bool) -> Any:
    out = fn(*args)
    if not backward:
        return out
    return torch.autograd.grad(out, args[:4], torch.ones_like(out))


def peak_bytes(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], backward: bool) -> int:
    with memory.peak() as record:
        result = step(fn, args, backward)
        del result
    return record.peak_bytes


def run(n: int, heads: int, dim: int, dtype: str, backward: bool, repeat: int) -> dict[str, Any]:
    args = inputs(n, heads, dim, DTYPES[dtype], backward)
    sides = {"fused": fused, "composite": op.composite, "additive": op.additive_mask_composite}
    tol = 2e-2 if dtype == "bf16" else 1e-3
    got = step(fused, args, backward)
    for baseline in (op.composite, op.additive_mask_composite):  # the same result
        expected = step(baseline, args, backward)
        pairs = zip(expected if backward else [expected], got if backward else [got], strict=True)
        for e, a in pairs:
            torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeat):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            start = time.perf_counter()
            step(sides[name], args, backward)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "n": n,
        "dtype": dtype,
        "pass": "fwdbwd" if backward else "fwd",
        "fused_ms": med["fused"] * 1e3,
        "composite_ms": med["composite"] * 1e3,
        "additive_ms": med["additive"] * 1e3,
        "ratio": med["composite"] / med["fused"],
        "additive_ratio": med["additive"] / med["fused"],
        "fused_peak_mb": peak_bytes(fused, args, backward) / 2**20,
        "composite_peak_mb": peak_bytes(op.composite, args, backward) / 2**20,
        "additive_peak_mb": peak_bytes(op.additive_mask_composite, args, backward) / 2**20,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--passes", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    a = parser.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; q [1, N, N, {a.heads}, "
        f"{a.dim}], bias [1, {a.heads}, N, N], mask [1, N, N]; median of {a.repeat}"
    )
    print(
        "N    dtype pass    fused ms  composite ms (ratio)  additive-mask ms (ratio)  "
        "peak MB fused / composite / additive"
    )
    for n in a.tokens:
        for dtype in a.dtypes:
            for phase in a.passes:
                r = run(n, a.heads, a.dim, dtype, phase == "fwdbwd", a.repeat)
                print(
                    f"{n:<4} {dtype:<5} {r['pass']:<7} {r['fused_ms']:8.1f}  "
                    f"{r['composite_ms']:8.1f} ({r['ratio']:5.2f}x)  "
                    f"{r['additive_ms']:12.1f} ({r['additive_ratio']:5.2f}x)  "
                    f"{r['fused_peak_mb']:8.1f} / {r['composite_peak_mb']:.1f} / "
                    f"{r['additive_peak_mb']:.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
