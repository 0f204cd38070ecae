"""The tiny Llama training step (``spore bench dvm -k llama-train``'s model) on batches whose
length changes from step to step, as with length-bucketed batches. Under dynamo's default
(automatic dynamic shapes) the second length recompiles the model once with symbolic sizes;
dvm then compiles that graph again for each length it runs with (``dvm.specialize``).

Sides, all from the same seeded weights, each length's batch cut from one seeded batch:

- ``eager``: the model as it is;
- ``dvm``: ``torch.compile(backend="dvm")``;
- ``dvm_unspecialised``: the same graphs, each compiled once as traced (what dvm did before:
  a graph with symbolic sizes ran every node eagerly);
- ``dvm_static``: ``torch.compile(backend="dvm", dynamic=False)``: dynamo compiles the model
  again for each length;
- ``inductor``: ``torch.compile()`` (Inductor's kernels for symbolic sizes).

First, each side runs one step at each length of ``--lengths`` in turn: those first steps'
times (compiles included), in ms. Then ``--rounds`` interleaved rounds, each side a step at
every length: the median step time for each length, in ms, and against eager.

    python packages/dvm/tools/dynamic_lengths.py --lengths 128,96,112,80 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

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


def _stepper(dtype: torch.dtype, options: dict[str, Any] | None) -> Callable[[int], None]:
    """A training step (forward, loss, backward, SGD) of the seeded model on the first
    ``length`` tokens of its batch, compiled with ``options`` (eager when ``None``)."""
    model, ids = benchmarks.seeded_llama(dtype)
    forward = model if options is None else torch.compile(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(length: int) -> None:
        batch = ids[:, :length]
        optimizer.zero_grad(set_to_none=True)
        forward(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()

    return step


def _lengths(text: str) -> list[int]:
    lengths = [int(s) for s in text.split(",")]
    if len(lengths) < 2 or not all(2 <= n <= benchmarks.LLAMA.seq for n in lengths):
        raise ValueError(f"give two or more lengths between 2 and {benchmarks.LLAMA.seq}")
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--lengths", default="128,96,112,80", help="comma-separated lengths")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    try:
        lengths = _lengths(args.lengths)
    except ValueError as e:
        parser.error(f"--lengths: {e}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    torch.set_num_threads(args.threads)
    dtype = benchmarks.DTYPES[args.dtype]
    torch._dynamo.config.recompile_limit = 64  # dvm_static compiles each length anew
    steps = {}
    print("first step at each length, ms (compiles included): " + ", ".join(map(str, lengths)))
    for name, options in _sides().items():
        torch._dynamo.reset()
        steps[name] = step = _stepper(dtype, options)
        firsts = []
        for n in lengths:
            start = time.perf_counter()
            step(n)
            firsts.append(f"{1e3 * (time.perf_counter() - start):7.1f}")
        print(f"{name:18s} {' '.join(firsts)}", flush=True)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in lengths} for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            for n in lengths:
                start = time.perf_counter()
                step(n)
                times[name][n].append(1e3 * (time.perf_counter() - start))
    print(f"steady step, ms (median of {args.rounds}; against eager in brackets)")
    eager = {n: statistics.median(ms) for n, ms in times["eager"].items()}
    for name, by_length in times.items():
        cells = []
        for n, ms in by_length.items():
            m = statistics.median(ms)
            cells.append(f"{n}: {m:6.2f} ({eager[n] / m:.2f}x)")
        print(f"{name:18s} {'  '.join(cells)}")


if __name__ == "__main__":
    main()
