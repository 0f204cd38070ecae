"""Changing sizes from call to call, as with length-bucketed batches: the tiny Llama training
step (``spore bench dvm -k llama-train``'s model) at several sequence lengths, or with
``--chain NAME`` one of the bench's chains at several row counts. Under dynamo's default
(automatic dynamic shapes) the second size recompiles with symbolic sizes; dvm then compiles
that graph again for each size it runs with (``dvm.specialize``).

Sides, all from the same seeded weights and inputs (each size cut from them):

- ``eager``: as it is;
- ``dvm``: ``torch.compile(backend="dvm")``;
- ``dvm_unspecialised``: the same graphs, each compiled once as traced (what dvm did before:
  a graph with symbolic sizes ran every node eagerly);
- ``dvm_static``: ``torch.compile(backend="dvm", dynamic=False)``: dynamo compiles again for
  each size;
- ``inductor``: ``torch.compile()`` (Inductor's kernels for symbolic sizes; its caches off).

First, each side runs once at each size in turn, from a reset dynamo: those first calls'
times (compiles included), in ms. Then one untimed round (each reset dropped the compiles of
the sides before it, which compile again there) and ``--rounds`` interleaved rounds, each
side a call at every size: the median time for each size, in ms, and eager's time over it.

    python packages/dvm/tools/dynamic_lengths.py --sizes 128,96,112,80 --rounds 7
    python packages/dvm/tools/dynamic_lengths.py --chain softmax --sizes 1024,768,896,640
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.utils import fresh_cache

from dvm import benchmarks
from dvm.compile import compile_graph
from spore import runtime


def _sides() -> dict[str, dict[str, Any] | None]:
    return {
        "eager": None,
        "dvm": {"backend": "dvm"},
        "dvm_unspecialised": {"backend": benchmarks.aot_backend(compile_graph)},
        "dvm_static": {"backend": "dvm", "dynamic": False},
        "inductor": {},
    }


def _chain_call(
    name: str, dtype: torch.dtype, options: dict[str, Any] | None
) -> Callable[[int], None]:
    """The chain on the first ``rows`` rows of its ``[1024, 4096]`` inputs, under no_grad."""
    spec = benchmarks.CHAINS[name]
    inputs = spec.inputs((1024, 4096), dtype)
    fn = spec.fn if options is None else torch.compile(spec.fn, **options)

    def call(rows: int) -> None:
        with torch.no_grad():
            fn(*(t[:rows] if t.dim() == 2 else t for t in inputs))

    return call


def _sizes(text: str, most: int) -> list[int]:
    sizes = [int(s) for s in text.split(",")]
    if len(sizes) < 2 or not all(2 <= n <= most for n in sizes):
        raise ValueError(f"give two or more sizes between 2 and {most}")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--chain", choices=sorted(benchmarks.CHAINS), help="a chain, not Llama")
    parser.add_argument("--sizes", help="comma-separated lengths (rows with --chain)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    most = 1024 if args.chain else benchmarks.LLAMA.seq
    try:
        sizes = _sizes(args.sizes or ("1024,768,896,640" if args.chain else "128,96,112,80"), most)
    except ValueError as e:
        parser.error(f"--sizes: {e}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    torch.set_num_threads(args.threads)
    dtype = benchmarks.DTYPES[args.dtype]
    torch._dynamo.config.recompile_limit = 64  # dvm_static compiles each size anew
    torch.compile(lambda x: x * 2 + 1, backend="dvm")(torch.ones(3))  # dynamo's one-time set-up
    torch._dynamo.reset()
    calls = {}
    print(f"first call at each size, ms (compiles included): {', '.join(map(str, sizes))}")
    for name, options in _sides().items():
        torch._dynamo.reset()
        if args.chain:
            calls[name] = call = _chain_call(args.chain, dtype, options)
        else:
            calls[name] = call = benchmarks.llama_step(dtype, options)
        firsts = []
        with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=False):
            for n in sizes:
                start = time.perf_counter()
                call(n)
                firsts.append(f"{1e3 * (time.perf_counter() - start):7.1f}")
        print(f"{name:18s} {' '.join(firsts)}", flush=True)
    for call in calls.values():  # untimed: the reset before each side's first calls dropped
        for n in sizes:  # the sides' compiles before it, which recompile here
            call(n)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            for n in sizes:
                start = time.perf_counter()
                call(n)
                times[name][n].append(1e3 * (time.perf_counter() - start))
    print(f"steady call, ms (median of {args.rounds}; eager's time over it in brackets)")
    eager = {n: statistics.median(ms) for n, ms in times["eager"].items()}
    for name, by_size in times.items():
        cells = []
        for n, ms in by_size.items():
            m = statistics.median(ms)
            cells.append(f"{n}: {m:6.2f} ({eager[n] / m:.2f}x)")
        print(f"{name:18s} {'  '.join(cells)}")


if __name__ == "__main__":
    main()
