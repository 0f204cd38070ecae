"""Where a benchmark model's step goes, mfusion against plain Inductor, from ``torch.profiler``.

Builds the sides of ``spore bench mfusion``'s case (the same model, batch and compile; the
process restarts under ``spore bench``'s tuned runtime), runs ``--steps`` steps of each under
the profiler, and prints per side: the step time, the share of self CPU time in GEMMs (mm,
addmm, bmm, baddbmm) and attention (SDPA), and the top operators and kernels by self time
(Inductor's generated kernels named through ``torch._inductor.config.cpp.enable_kernel_profile``).
The share left after GEMMs and attention bounds what any fusion can gain.

    python packages/mfusion/tools/profile_forward.py --model llama --dtype fp32
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mfusion import benchmarks
from spore import runtime

GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkl_linear")
ATTENTION = ("scaled_dot_product", "flash_attention")


def _report(side: str, prof: profile, steps: int, top: int) -> None:
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM)
    attention = sum(e.self_cpu_time_total for e in events if any(a in e.key for a in ATTENTION))
    print(
        f"{side}: {total / steps / 1e3:.2f} ms of self CPU time a step; GEMMs "
        f"{100 * gemm / total:.1f} %, attention {100 * attention / total:.1f} %, the rest "
        f"{100 * (total - gemm - attention) / total:.1f} %"
    )
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        share = 100 * e.self_cpu_time_total / total
        each = e.self_cpu_time_total / max(e.count, 1)
        print(f"  {share:5.1f} %  {e.count // steps:4d} a step  {each:8.1f} us each  {e.key[:70]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=benchmarks.BENCH_MODELS, default="llama")
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--phase", choices=benchmarks.PHASES, default="fwd")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12, help="operators listed per side")
    args = parser.parse_args()
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        state = benchmarks._state(args.model, args.phase, args.dtype)
    for side in ("inductor", "mfusion"):
        step = state.steps[side]
        for _ in range(3):
            step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        _report(side, prof, args.steps, args.top)


if __name__ == "__main__":
    main()
