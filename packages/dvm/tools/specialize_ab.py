"""A model cycling through more sets of sizes than dvm keeps compiled, against the former
policy (the 16 sets used last kept, any other compiled again at each call), both in this
process: the former ``specialize.py`` is read from git (commit 69af134) and loaded beside the
current one.

The model: a bench chain (``--chain``) under no_grad on the first 1024, 1008, ... rows
(``--sizes`` of them, 16 apart) of its [1024, 4096] inputs in turn; or with ``--llama`` the
tiny Llama training step (``spore bench dvm -k llama-train``'s model) on its first 128, 124,
... tokens (4 apart). fp32, ``torch.compile(dynamic=True)``, AOT autograd with dvm's
decompositions. Sides: eager; the former policy; the current one (16 sets kept at first,
one more for each dropped set that comes back); the current one with ``size_limit`` half the
number of sizes (the other sets run eagerly). After two untimed passes, ``--rounds``
interleaved rounds, each a call at every size: each side's mean call (the median round's, in
ms), eager's time over it, and its compiles and eager calls in all. With ``--memory N``, then
N more passes of each specialising side under tracemalloc: what Python holds after them
against before, per call. Run from the repository (it calls git).

    python packages/dvm/tools/specialize_ab.py --sizes 24 --rounds 7 --memory 20
    python packages/dvm/tools/specialize_ab.py --llama --sizes 24 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
import warnings
from typing import Any

import earlier
import torch

from dvm import benchmarks, specialize
from dvm.compile import compile_graph
from spore import runtime

FORMER = "69af134"


class _Side:
    """The model (``chain``'s, or the Llama step's for ``None``) with each graph through
    ``specializing(gm, compile_graph, **kwargs)`` (eager for ``None``); ``made`` keeps those
    objects."""

    def __init__(self, chain: str | None, specializing: type | None, **kwargs: Any) -> None:
        self.made: list[Any] = []

        def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
            self.made.append(specializing(gm, compile_graph, **kwargs))
            return self.made[-1]

        options = None
        if specializing is not None:
            options = {"backend": benchmarks.aot_backend(compiler), "dynamic": True}
        if chain is None:
            self.call = benchmarks.llama_step(torch.float32, options)
            return
        spec = benchmarks.CHAINS[chain]
        inputs = spec.inputs((1024, 4096), torch.float32)

        def run(*args: torch.Tensor) -> Any:
            return spec.fn(*args)

        # a code object of its own: dynamo keeps its compiles per code object
        run.__code__ = run.__code__.replace()
        fn = spec.fn if options is None else torch.compile(run, **options)

        def call(rows: int) -> None:
            with torch.no_grad():
                fn(*(t[:rows] if t.dim() == 2 else t for t in inputs))

        self.call = call

    def __call__(self, size: int) -> None:
        self.call(size)

    def counts(self) -> str:
        compiles = sum(len(s.specialize_us) for s in self.made)
        eager = sum(getattr(s, "eager_calls", 0) for s in self.made)
        return f"{compiles} compiles, {eager} eager calls"


def _memory(side: _Side, sizes: list[int], passes: int) -> float:
    """Bytes Python holds after ``passes`` passes over ``sizes`` against before, per call."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(passes):
            for n in sizes:
                side(n)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / (passes * len(sizes))
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", choices=sorted(benchmarks.CHAINS), default="gelu_tanh")
    parser.add_argument("--llama", action="store_true", help="the tiny Llama step, not a chain")
    parser.add_argument("--sizes", type=int, default=24, help="how many, 17 to 30")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--memory", type=int, default=0, help="passes under tracemalloc")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not specialize.LIMIT < args.sizes <= 30:
        parser.error(f"--sizes must be more than {specialize.LIMIT} (dvm's default) and at most 30")
    if args.rounds < 1 or args.memory < 0:
        parser.error("--rounds must be at least 1 and --memory not negative")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", "dvm: a graph with symbolic sizes", RuntimeWarning)
    chain = None if args.llama else args.chain
    first, step = (benchmarks.LLAMA.seq, 4) if args.llama else (1024, 16)
    sizes = [first - step * k for k in range(args.sizes)]
    sides = {
        "eager": _Side(chain, None),
        f"former ({FORMER})": _Side(chain, earlier.module(FORMER, "specialize").Specializing),
        "current": _Side(chain, specialize.Specializing),
        f"size_limit {args.sizes // 2}": _Side(
            chain, specialize.Specializing, compiles=args.sizes // 2
        ),
    }
    for side in sides.values():
        for _ in range(2):
            for n in sizes:
                side(n)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, side in sides.items():
            start = time.perf_counter()
            for n in sizes:
                side(n)
            times[name].append(1e3 * (time.perf_counter() - start) / len(sizes))
    what = "Llama step, tokens" if args.llama else f"{args.chain}, rows of 4096"
    print(
        f"{what}: {sizes[-1]} to {sizes[0]} in turn, fp32: mean call, ms "
        f"(median of {args.rounds} rounds; eager's time over it)"
    )
    eager = statistics.median(times["eager"])
    for name, ms in times.items():
        m = statistics.median(ms)
        counts = "" if name == "eager" else f"  {sides[name].counts()}"
        print(f"{name:18s} {m:7.2f} ({eager / m:.2f}x; {min(ms):.2f}-{max(ms):.2f}){counts}")
    if args.memory:
        print(f"Python memory held after {args.memory} more passes, per call")
        for name, side in list(sides.items())[1:3]:
            print(f"{name:18s} {_memory(side, sizes, args.memory):7.0f} B")


if __name__ == "__main__":
    main()
