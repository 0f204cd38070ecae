"""Each dvm region of the tiny Llama training step (``spore bench dvm -k llama-train``'s
model) timed on the VM against its own aten nodes, inside the real step.

Every region call runs, at random, either on the VM or as its aten nodes (both give the
step's result), and is timed; after the steps each line gives a region's median time each
way, its domain and its ops, the region that gains least first, then the totals a step.
Timing inside the step keeps what a microbenchmark loses: the caches a region meets right
after the matmuls and attention around it.

    python packages/dvm/tools/llama_regions.py --dtype fp32 --steps 60
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

from dvm import benchmarks
from dvm.compile import RegionRunner
from spore import runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    parser.add_argument("--steps", type=int, default=60, help="training steps timed")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    torch.set_num_threads(args.threads)
    trainer = benchmarks._trainer(args.dtype, "dvm")  # compiled, checked against eager
    on_vm: dict[RegionRunner, list[float]] = defaultdict(list)
    eager: dict[RegionRunner, list[float]] = defaultdict(list)
    call = RegionRunner.__call__

    def either(self: RegionRunner, *inputs: Any) -> Any:
        way, fn = (on_vm, call) if random.random() < 0.5 else (eager, RegionRunner.eager)
        start = time.perf_counter()
        result = fn(self, *inputs)
        way[self].append(time.perf_counter() - start)
        return result

    RegionRunner.__call__ = either
    try:
        for _ in range(args.steps):
            trainer.step()
    finally:
        RegionRunner.__call__ = call
    rows = []
    for runner in on_vm.keys() & eager.keys():
        vm_us = 1e6 * statistics.median(on_vm[runner])
        eager_us = 1e6 * statistics.median(eager[runner])
        ops = " ".join(op.split(".")[1] for op in runner.region.ops)
        rows.append((eager_us - vm_us, vm_us, eager_us, runner.region.domain, ops))
    for _, vm_us, eager_us, domain, ops in sorted(rows, key=lambda r: r[0]):
        print(f"vm {vm_us:7.1f} us  eager {eager_us:7.1f} us  {domain}  {ops}")
    total_vm, total_eager = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(
        f"a step: {len(rows)} regions, {total_vm / 1e3:.2f} ms on the VM, "
        f"{total_eager / 1e3:.2f} ms as aten"
    )


if __name__ == "__main__":
    main()
