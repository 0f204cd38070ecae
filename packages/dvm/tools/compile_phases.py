"""dvm's compile of each benchmark chain's aten graph, phase by phase.

``spore bench dvm -k compile`` gives the whole compile against Inductor's; this splits dvm's
side: the per-node analysis (supported ops, domain shapes, cuts), clustering (the analysis
plus merging), building the region's program, preparing its runner (encoding, binding the
launch), scheduling the graph, and the whole ``compile_graph``. Medians of ``--repeat``
calls on one graph, in µs.

    python packages/dvm/tools/compile_phases.py --repeat 300
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from dvm import benchmarks, cluster
from dvm.compile import RegionRunner, _schedule, compile_graph
from spore import runtime


def _median_us(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def _phases(name: str) -> dict[str, Callable[[], Any]]:
    """Each phase of dvm's compile of chain ``name``'s graph (one region), ready to time."""
    gm, inputs = benchmarks._aten_graph(name)
    (runner,) = compile_graph(gm, inputs).runners
    region = runner.region
    nodes = list(gm.graph.nodes)
    analysis = cluster._Analysis(nodes)
    return {
        "analysis": lambda: cluster._Analysis(nodes),
        "cluster": lambda: cluster._Clusterer(gm).run(),
        "build": lambda: cluster.build_region(region.nodes, analysis),
        "runner": lambda: RegionRunner(region, 0),
        "schedule": lambda: _schedule(gm, [runner]),
        "total": lambda: compile_graph(gm, inputs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    for name in benchmarks.CHAINS:
        phases = _phases(name)
        times = "  ".join(f"{k} {_median_us(f, args.repeat):5.0f}" for k, f in phases.items())
        print(f"{name:10s} {times}")


if __name__ == "__main__":
    main()
