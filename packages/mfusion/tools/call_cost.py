"""What one spore op call costs right after a GEMM, layer by layer, on a tiny tensor.

Inside a compiled model each spore op runs after a large matmul has pushed the interpreter's
code and data out of the caches, so its Python path costs far more than in a loop. This times
``torch.ops.spore.silu_mul`` on a 4 x 8 tensor right after a ``[512, 512] x [512, 1408]``
matmul, and each layer below it alone: the core's kernel route (selection and ``supports``),
spore-kernels' CPU wrapper (output allocation, pointers, the ctypes call) and the bare ctypes
call; an aten ``mul`` and an empty lambda for scale. Medians over ``--calls`` calls, in µs,
with the same calls warm (no matmul between them) beside them. The process restarts under
``spore bench``'s tuned runtime.

    python packages/mfusion/tools/call_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from spore import runtime


def _layers() -> dict[str, Callable[[], object]]:
    import spore
    from spore import dispatch
    from spore_kernels import _lib
    from spore_kernels.ops import glu

    spore.get_registry("ops")  # defines the spore ops
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    y = torch.empty_like(a)
    op, route = torch.ops.spore.silu_mul.default, dispatch.get("silu_mul")._route
    fn = _lib.function("spore_silu_mul", glu._SILU_MUL)
    ptrs = (a.data_ptr(), b.data_ptr(), y.data_ptr())
    return {
        "torch.ops.spore.silu_mul": lambda: op(a, b),
        "the core's route (selection, supports)": lambda: route(a, b),
        "spore-kernels' CPU wrapper": lambda: glu.cpu_silu_mul(a, b),
        # y as a default argument: the lambda keeps the output its pointer writes to alive
        "the bare ctypes call": lambda y=y: fn(*ptrs, y.numel(), 0, _lib.threads()),
        "aten mul (for scale)": lambda: torch.mul(a, b),
        "an empty lambda": lambda: None,
    }


def _median_us(call: Callable[[], object], before: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        before()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times[calls // 10 :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    x, w = torch.randn(512, 512), torch.randn(1408, 512)
    print(f"{'layer':42s} {'after a GEMM':>13s} {'warm':>8s}")
    with torch.no_grad():
        for name, call in _layers().items():
            cold = _median_us(call, lambda: torch.nn.functional.linear(x, w), args.calls)
            warm = _median_us(call, call, args.calls)
            print(f"{name:42s} {cold:10.1f} µs {warm:5.1f} µs")


if __name__ == "__main__":
    main()
