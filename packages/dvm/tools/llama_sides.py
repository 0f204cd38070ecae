"""The tiny Llama training step (``spore bench dvm -k llama-train``'s model) under eager, AOT
autograd without fusion and dvm, and two sides between them, to tell apart what dvm's step
costs: its decompositions, its executor, its regions.

Sides, all built from the same seeded weights and batch and timed interleaved in this process
(median over ``--rounds`` of ``--steps`` steps each, in ms):

- ``eager``: the model as it is;
- ``aot_eager``: ``torch.compile(backend="aot_eager")``, AOT autograd's graphs run as generated
  code, no decompositions;
- ``aot_dvm_decomp``: the same with dvm's decompositions (``dvm.lower.decomposition_table``);
- ``dvm_no_regions``: dvm's backend with no region (every node eager, dvm's executor);
- ``dvm``: ``torch.compile(backend="dvm")``;
- ``dvm_silu_decomposed``: the same with SiLU decomposed (dvm keeps it whole, lowered whole:
  what this costs or saves in the step).

    python packages/dvm/tools/llama_sides.py --dtype fp32 --rounds 11
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from dvm import benchmarks
from dvm.backend import make_backend
from dvm.compile import compile_graph
from dvm.lower import decomposition_table
from spore import runtime


def _sides() -> dict[str, Any]:
    return {
        "eager": None,
        "aot_eager": "aot_eager",
        "aot_dvm_decomp": benchmarks.aot_backend(lambda gm, _: gm.forward),
        "dvm_no_regions": benchmarks.aot_backend(
            lambda gm, ex: compile_graph(gm, ex, min_ops=2**31)
        ),
        "dvm": "dvm",
        "dvm_silu_decomposed": make_backend(
            decompositions=decomposition_table(also=[torch.ops.aten.silu])
        ),
    }


def _stepper(dtype: torch.dtype, backend: Any) -> Callable[[], None]:
    """A training step of the seeded model on its whole batch under ``backend``, compiled and
    warmed up by two steps."""
    step = benchmarks.llama_step(dtype, None if backend is None else {"backend": backend})
    seq = benchmarks.LLAMA.seq
    step(seq)
    step(seq)
    return lambda: step(seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="steps timed per round and side")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    torch.set_num_threads(args.threads)
    dtype = benchmarks.DTYPES[args.dtype]
    steps = {name: _stepper(dtype, backend) for name, backend in _sides().items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append(1e3 * (time.perf_counter() - start) / args.steps)
    for name, ms in times.items():
        print(f"{name:15s} {statistics.median(ms):6.2f} ms  ({min(ms):.2f}-{max(ms):.2f})")


if __name__ == "__main__":
    main()
