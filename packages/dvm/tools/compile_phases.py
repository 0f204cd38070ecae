"""dvm's compile of each benchmark chain's aten graph, phase by phase.

``spore bench dvm -k compile`` gives the whole compile against Inductor's; this splits dvm's
side: the per-node analysis (supported ops, domain shapes, cuts), clustering (the analysis
plus merging), building the region's program, preparing its runner (encoding, binding the
launch), scheduling the graph, and the whole ``compile_graph``. Medians of ``--repeat``
calls, in µs. ``--cold`` times each call on a fresh copy of the graph right after another
copy was made (the copy evicts some of the caches); without it, calls repeat on one graph
with warm caches. ``--flow`` reads the times each compile records of itself where the backend
runs it, inside ``torch.compile`` right after tracing (as ``spore bench dvm -k compile`` does,
and colder still than ``--cold``): the whole compile, clustering (analysis, merging and
building the program), the program's build alone, preparing the runner, scheduling, and the
region's own compile (build + runner).

    python packages/dvm/tools/compile_phases.py --repeat 300 [--cold]
    python packages/dvm/tools/compile_phases.py --flow --repeat 30
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch.fx import GraphModule

from dvm import benchmarks, cluster
from dvm.compile import RegionRunner, _schedule, compile_graph
from spore import runtime

PHASES = ("analysis", "cluster", "build", "runner", "schedule", "total")


def _phase(name: str, gm: GraphModule, inputs: list[Any], min_ops: int) -> Callable[[], Any]:
    """Phase ``name`` of the compile of ``gm`` (one region), its inputs made beforehand."""
    nodes = list(gm.graph.nodes)
    if name == "analysis":
        return lambda: cluster._Analysis(nodes)
    if name == "cluster":
        return lambda: cluster._Clusterer(gm).run()
    if name == "total":
        return lambda: compile_graph(gm, inputs, min_ops=min_ops)
    (runner,) = compile_graph(gm, inputs, min_ops=min_ops).runners
    region = runner.region
    if name == "build":
        analysis = cluster._Analysis(nodes)
        return lambda: cluster.build_region(region.nodes, analysis)
    if name == "runner":
        return lambda: RegionRunner(region, 0)
    return lambda: _schedule(gm, [runner])


def _median_us(chain: str, name: str, repeat: int, cold: bool) -> float:
    gm, inputs = benchmarks._aten_graph(chain)
    min_ops = benchmarks.CHAINS[chain].min_ops
    warm = _phase(name, gm, inputs, min_ops)
    times = []
    for _ in range(repeat):
        fn = warm
        if cold:
            fn = _phase(name, copy.deepcopy(gm), inputs, min_ops)
            copy.deepcopy(gm)  # evicts what making the phase's inputs left in the caches
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


FLOW_PHASES = {
    "cluster": lambda g: g.clustering.cluster_us,
    "build": lambda g: sum(r.region.build_us for r in g.runners),
    "runner": lambda g: sum(r.prepare_us for r in g.runners),
    "schedule": lambda g: g.schedule_us,
    "total": lambda g: g.total_us,
    "region": lambda g: sum(r.compile_us for r in g.runners),
}


def _flow(chain: str, repeat: int) -> str:
    graphs = benchmarks.flow_compiles(chain, repeat)
    return "  ".join(
        f"{name} {statistics.median(phase(g) for g in graphs):5.0f}"
        for name, phase in FLOW_PHASES.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--cold", action="store_true", help="each call on a fresh copy")
    parser.add_argument("--flow", action="store_true", help="inside torch.compile, as the bench")
    args = parser.parse_args()
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    for chain in benchmarks.CHAINS:
        if args.flow:
            print(f"{chain:10s} {_flow(chain, args.repeat)}")
            continue
        times = "  ".join(
            f"{name} {_median_us(chain, name, args.repeat, args.cold):5.0f}" for name in PHASES
        )
        print(f"{chain:10s} {times}")


if __name__ == "__main__":
    main()
