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

region's own compile (build + runner). ``--llama`` does the same for the tiny Llama training
step's forward and backward graphs (``spore bench dvm -k llama-train``'s model): each graph's
compile, its regions and eager nodes, and each region's own compile.

    python packages/dvm/tools/compile_phases.py --repeat 300 [--cold]
    python packages/dvm/tools/compile_phases.py --flow --repeat 30
    python packages/dvm/tools/compile_phases.py --llama --repeat 3 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
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


def _llama(dtype: str, repeat: int) -> None:
    from dvm.backend import make_backend

    regions, graphs = [], []
    backend = make_backend(lambda _kind, graph: graphs.append(graph))
    for _ in range(repeat):
        torch._dynamo.reset()
        model, ids = benchmarks.seeded_llama(benchmarks.DTYPES[dtype])
        graphs.clear()
        compiled = torch.compile(model, backend=backend)
        compiled(input_ids=ids, labels=ids).loss.backward()
        for kind, g in zip(("forward", "backward"), graphs, strict=True):
            eager = len(g.clustering.fallbacks)
            print(f"{kind:8s} {g.total_us:7.0f} µs  {len(g.runners)} regions, {eager} eager nodes")
            regions += [r.compile_us for r in g.runners]
    deciles = statistics.quantiles(regions, n=10)
    print(
        f"a region's own compile ({len(regions)} regions): median {statistics.median(regions):.0f}"
        f" µs, 10th percentile {deciles[0]:.0f}, 90th {deciles[-1]:.0f}, max {max(regions):.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--cold", action="store_true", help="each call on a fresh copy")
    parser.add_argument("--flow", action="store_true", help="inside torch.compile, as the bench")
    parser.add_argument("--llama", action="store_true", help="the tiny Llama step's graphs")
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2 (medians and percentiles of the compiles)")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    if args.llama:
        _llama(args.dtype, args.repeat)
        return
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
