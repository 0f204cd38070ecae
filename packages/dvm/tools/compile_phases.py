"""dvm's compile of each benchmark chain's aten graph, phase by phase.

``spore bench dvm -k compile`` gives the whole compile against Inductor's; this splits dvm's
side: the per-node analysis (supported ops, domain shapes, cuts), clustering (the analysis plus
merging), building the region's program, preparing its runner (encoding, binding the launch),
scheduling the graph, and the whole ``compile_graph``. Medians of ``--repeat`` calls, in µs.
``--cold`` times each call on a fresh copy of the graph right after another copy was made (the
copy evicts some of the caches); without it, calls repeat on one graph with warm caches.
``--flow`` reads the times each compile records of itself where the backend runs it, inside
``torch.compile`` right after tracing (as ``spore bench dvm -k compile`` does, and colder still
than ``--cold``): the whole compile, clustering (analysis, merging and building the program),
the program's build alone, preparing the runner, scheduling, and the region's own compile
(build + runner). ``--llama`` does the same for the tiny Llama training step's forward and
backward graphs (``spore bench dvm -k llama-train``'s model): each graph's compile, its regions
and eager nodes, and each region's own compile. ``--evict`` times the whole compile and its
phases as ``--flow`` reads them, each on a fresh copy of the graph after a 64 MiB write has
evicted the CPU's caches (the cold caches of ``--flow`` without its tracing, whose 0.1 s a
compile makes ``--flow`` slow to repeat and noisy: an A/B check of a change). ``--floor``
times, in the same place, only what a compile done in native code would still need of Python:
the graph read into flat arrays by Python (each node's op, arguments, shape, strides and
dtype), that plus one ctypes call into the VM's library, and the graph read by C (each node's
op, target, arguments, shape and dtype; a small extension built with the system compiler);
next to dvm's whole compile, the four taking turns.
``--depths N`` times dvm's compile in the same place with the backend called 0 to N-1
frames deeper: CPython keeps frames in 16 KiB chunks, and 3.11 and 3.12 allocate and free one
at each call that crosses a chunk's end (CPython issue gh-142183, fixed in later releases by
keeping one), so the compile's time depends on the depth it runs at. ``--warmed`` times dvm's
compile in the same place after another chain's compile ran, untimed, up to each of its phases
(none, the analysis, the merging, the build, the runners, all of it), the six taking turns:
each step's drop is what the first touch of that phase's code and data costs a cold compile.

    python packages/dvm/tools/compile_phases.py --repeat 300 [--cold]
    python packages/dvm/tools/compile_phases.py --flow --repeat 30
    python packages/dvm/tools/compile_phases.py --evict --repeat 200
    python packages/dvm/tools/compile_phases.py --floor --repeat 30
    python packages/dvm/tools/compile_phases.py --llama --repeat 3 [--dtype bf16]
    python packages/dvm/tools/compile_phases.py --depths 40 --repeat 7
    python packages/dvm/tools/compile_phases.py --warmed --repeat 15
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from dvm import _analysis, _lib, benchmarks, cluster
from dvm.compile import RegionRunner, _schedule, compile_graph
from spore import runtime

PHASES = ("analysis", "cluster", "build", "runner", "schedule", "total")


def _phase(name: str, gm: GraphModule, inputs: list[Any], min_ops: int) -> Callable[[], Any]:
    """Phase ``name`` of the compile of ``gm`` (one region), its inputs made beforehand."""
    nodes = list(gm.graph.nodes)
    if name == "analysis":
        return lambda: cluster._Analysis(nodes)
    if name == "cluster":
        return lambda: cluster._Analysis(nodes).groups()
    if name == "total":
        return lambda: compile_graph(gm, inputs, min_ops=min_ops)
    (runner,) = compile_graph(gm, inputs, min_ops=min_ops).runners
    region = runner.region
    if name == "build":
        analysis = cluster._Analysis(nodes)
        return lambda: cluster.build_region(region.nodes, analysis)
    if name == "runner":
        return lambda: RegionRunner(region, 0)
    return lambda: _schedule(gm, [runner], nodes)


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


EVICT_BYTES = 64 << 20


def _evicted(chain: str, repeat: int) -> list[Any]:
    """``repeat`` compiles of ``chain``'s graph, each on a fresh copy after a write of
    :data:`EVICT_BYTES` (several times the L2 cache) has pushed the compile's code and data out
    of the CPU's caches."""
    gm, inputs = benchmarks._aten_graph(chain)
    min_ops = benchmarks.CHAINS[chain].min_ops
    sweep = torch.zeros(EVICT_BYTES // 4)
    graphs = []
    for _ in range(repeat):
        fresh = copy.deepcopy(gm)
        sweep.add_(1.0)
        graphs.append(compile_graph(fresh, inputs, min_ops=min_ops))
    return graphs


def _flow(chain: str, repeat: int, evict: bool = False) -> str:
    graphs = (_evicted if evict else benchmarks.flow_compiles)(chain, repeat)
    return "  ".join(
        f"{name} {statistics.median(phase(g) for g in graphs):5.0f}"
        for name, phase in FLOW_PHASES.items()
    )


_KINDS: dict[str, int] = {}  # numbers for node kinds, ops (by id(target)) and dtypes
_CODES: dict[int, int] = {}
_DTYPES: dict[torch.dtype, int] = {}


def _flatten(gm: GraphModule) -> tuple[array, array]:
    """``gm`` as a native compile would need it: per node its kind, op number, arguments
    (node numbers; scalars in the second array) and its value's shape, strides and dtype."""
    ints, scalars = array("q"), array("d")
    number: dict[Node, int] = {}
    for k, n in enumerate(gm.graph.nodes):
        number[n] = k
        ints.append(_KINDS.setdefault(n.op, len(_KINDS)))
        if n.op == "call_function":
            code = _CODES.setdefault(id(n.target), len(_CODES))
            ints.append(code)
            for a in n.args:
                if type(a) is Node:
                    ints.append(number[a])
                elif type(a) in (int, float, bool):
                    scalars.append(a)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            ints.extend(val.shape)
            ints.extend(val.stride())
            ints.append(_DTYPES.setdefault(val.dtype, len(_DTYPES)))
    return ints, scalars


_READER = r"""
#include <Python.h>
// read(nodes): each torch.fx node's op, target and arguments, and its value's shape and dtype,
// into a C array, as a compile in native code would read them (generic attribute lookups; the
// arguments from the node's _args); the count of words read, or NULL with an exception.
static long long words[1 << 16];
static PyObject* read_graph(PyObject* m, PyObject* nodes) {
    static PyObject *op, *target, *args, *meta, *val, *shape, *dtype;
    if (op == NULL && ((op = PyUnicode_InternFromString("op")) == NULL ||
                       (target = PyUnicode_InternFromString("target")) == NULL ||
                       (args = PyUnicode_InternFromString("_args")) == NULL ||
                       (meta = PyUnicode_InternFromString("meta")) == NULL ||
                       (val = PyUnicode_InternFromString("val")) == NULL ||
                       (shape = PyUnicode_InternFromString("shape")) == NULL ||
                       (dtype = PyUnicode_InternFromString("dtype")) == NULL))
        return NULL;
    if (!PyList_Check(nodes)) return PyErr_Format(PyExc_TypeError, "read(nodes): a list");
    Py_ssize_t k = 0, cap = sizeof words / sizeof words[0] - 64;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes) && k < cap; ++i) {
        PyObject* n = PyList_GET_ITEM(nodes, i);
        PyObject* got[4] = {PyObject_GetAttr(n, op), PyObject_GetAttr(n, target),
                            PyObject_GetAttr(n, args), PyObject_GetAttr(n, meta)};
        int failed = !got[0] || !got[1] || !got[2] || !got[3];
        if (!failed) {
            words[k++] = (long long)(Py_uintptr_t)got[0] ^ (long long)(Py_uintptr_t)got[1];
            if (PyTuple_Check(got[2]))
                for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(got[2]) && j < 16; ++j)
                    words[k++] = (long long)(Py_uintptr_t)PyTuple_GET_ITEM(got[2], j);
            PyObject* v = PyDict_Check(got[3]) ? PyDict_GetItemWithError(got[3], val) : NULL;
            PyObject* s = v != NULL ? PyObject_GetAttr(v, shape) : NULL;
            PyObject* d = s != NULL ? PyObject_GetAttr(v, dtype) : NULL;
            if (s != NULL && PyTuple_Check(s))
                for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(s) && j < 16; ++j)
                    words[k++] = PyLong_AsLongLong(PyTuple_GET_ITEM(s, j));
            words[k++] = (long long)(Py_uintptr_t)d;
            Py_XDECREF(s);
            Py_XDECREF(d);
            PyErr_Clear();  // a value without a shape: nothing more to read
        }
        for (int j = 0; j < 4; ++j) Py_XDECREF(got[j]);
        if (failed) return NULL;
    }
    return PyLong_FromSsize_t(k);
}
static PyMethodDef methods[] = {{"read", read_graph, METH_O, 0}, {0}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "graph_reader", 0, -1, methods};
PyMODINIT_FUNC PyInit_graph_reader(void) { return PyModule_Create(&module); }
"""


@functools.lru_cache(maxsize=1)
def _reader() -> Callable[[list[Node]], int]:
    """``graph_reader.read``, built from :data:`_READER` into a temporary folder."""
    import importlib
    import sys
    import tempfile
    from pathlib import Path

    import _cext  # beside this script

    folder = Path(tempfile.mkdtemp(prefix="dvm-graph-reader-"))
    _cext.build(folder, "graph_reader", _READER)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module("graph_reader").read
    finally:
        sys.path.remove(str(folder))


def _floor(chain: str, repeat: int) -> str:
    """Medians of the flattening in Python alone, of it with one ctypes call, of the graph's
    read in C (:data:`_READER`, with the node list) and of dvm's compile, in µs: one compile in
    four each, in turn, so that all four run as cold."""
    lib, _ = _lib.library()
    read = _reader()
    modes = ("flatten", "flatten+call", "C read", "dvm's compile")
    times: dict[str, list[float]] = {m: [] for m in modes}
    min_ops = benchmarks.CHAINS[chain].min_ops

    def compiler(gm: GraphModule, inputs: Any) -> Callable[..., Any]:
        mode = modes[sum(map(len, times.values())) % len(modes)]
        if mode == "dvm's compile":
            compiled = compile_graph(gm, inputs, min_ops=min_ops)
            times[mode].append(1e-6 * compiled.total_us)  # its own time, as the bench reads it
            return compiled
        start = time.perf_counter()
        if mode == "C read":
            read(_analysis.nodes(gm.graph))
        else:
            _flatten(gm)
        if mode == "flatten+call":
            lib.dvm_max_row()
        times[mode].append(time.perf_counter() - start)
        return gm.forward

    benchmarks.compile_in_flow(chain, len(modes) * repeat, benchmarks.aot_backend(compiler))
    return "  ".join(f"{k} {1e6 * statistics.median(v):5.0f}" for k, v in times.items())


WARMED = ("none", "analysis", "merge", "build", "runner", "compile")
"""What ``--warmed`` runs of another chain's compile, untimed, before each timed compile."""


def _warm_up(upto: str, gm: GraphModule, inputs: list[Any], min_ops: int) -> None:
    """The phases of the compile of ``gm`` up to ``upto`` (:data:`WARMED`)."""
    if upto == "compile":
        compile_graph(gm, inputs, min_ops=min_ops)
        return
    nodes = list(gm.graph.nodes)
    if upto == "analysis":
        cluster._Analysis(nodes)
    elif upto == "merge":
        cluster._Analysis(nodes).groups()
    elif upto != "none":
        clustering = cluster._cluster(nodes, min_ops, None, (), 0.0)
        if upto == "runner":
            for k, region in enumerate(clustering.regions):
                RegionRunner(region, k)


def _warmed(chain: str, repeat: int) -> str:
    """The median of dvm's compile in µs where the backend runs it, each after the phases up
    to each of :data:`WARMED` of another chain's compile ran (untimed, on a copy made
    beforehand), the modes taking turns: what the first touch of each phase's code and data
    costs the cold compile (the drop from one mode to the next)."""
    other = "silu_mul" if chain != "silu_mul" else "silu"
    gm, inputs = benchmarks._aten_graph(other)
    copies = [copy.deepcopy(gm) for _ in range(len(WARMED) * repeat)]
    min_ops = benchmarks.CHAINS[chain].min_ops
    times: dict[str, list[float]] = {m: [] for m in WARMED}

    def compiler(graph: GraphModule, args: Any) -> Callable[..., Any]:
        done = sum(map(len, times.values()))
        mode = WARMED[done % len(WARMED)]
        _warm_up(mode, copies[done], inputs, benchmarks.CHAINS[other].min_ops)
        compiled = compile_graph(graph, args, min_ops=min_ops)
        times[mode].append(compiled.total_us)
        return compiled

    benchmarks.compile_in_flow(chain, len(WARMED) * repeat, benchmarks.aot_backend(compiler))
    return "  ".join(f"{k} {statistics.median(v):4.0f}" for k, v in times.items())


def _depths(chain: str, repeat: int, depths: int) -> str:
    """The median of dvm's compile at each extra call depth, in µs (the depths taking turns,
    so that the machine's load falls on all alike), and their range."""
    min_ops = benchmarks.CHAINS[chain].min_ops
    times: list[list[float]] = [[] for _ in range(depths)]

    def at(extra: int, slot: list[float], gm: GraphModule, inputs: Any) -> Callable[..., Any]:
        if extra:
            return at(extra - 1, slot, gm, inputs)
        compiled = compile_graph(gm, inputs, min_ops=min_ops)
        slot.append(compiled.total_us)
        return compiled

    def compiler(gm: GraphModule, inputs: Any) -> Callable[..., Any]:
        extra = sum(map(len, times)) % depths
        return at(extra, times[extra], gm, inputs)

    benchmarks.compile_in_flow(chain, depths * repeat, benchmarks.aot_backend(compiler))
    medians = [statistics.median(t) for t in times]
    each = " ".join(f"{m:.0f}" for m in medians)
    return f"{min(medians):5.0f} to {max(medians):5.0f}  (+0..+{depths - 1}: {each})"


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
    parser.add_argument("--evict", action="store_true", help="--flow's phases, caches evicted")
    parser.add_argument("--floor", action="store_true", help="what native code would still need")
    parser.add_argument("--llama", action="store_true", help="the tiny Llama step's graphs")
    parser.add_argument("--depths", type=int, default=0, help="extra call depths 0..N-1")
    parser.add_argument(
        "--warmed", action="store_true", help="--flow's compile after another's phases ran"
    )
    parser.add_argument("--dtype", choices=sorted(benchmarks.DTYPES), default="fp32")
    args = parser.parse_args()
    if args.repeat < 2:
        parser.error("--repeat must be at least 2 (medians and percentiles of the compiles)")
    runtime.restart_tuned()  # as `spore bench`: its tuned runtime
    if args.llama:
        _llama(args.dtype, args.repeat)
        return
    for chain in benchmarks.CHAINS:
        if args.depths:
            print(f"{chain:10s} {_depths(chain, args.repeat, args.depths)}")
            continue
        if args.warmed:
            print(f"{chain:10s} {_warmed(chain, args.repeat)}")
            continue
        if args.flow or args.floor:
            print(f"{chain:10s} {(_floor if args.floor else _flow)(chain, args.repeat)}")
            continue
        if args.evict:
            print(f"{chain:10s} {_flow(chain, args.repeat, evict=True)}")
            continue
        times = "  ".join(
            f"{name} {_median_us(chain, name, args.repeat, args.cold):5.0f}" for name in PHASES
        )
        print(f"{chain:10s} {times}")


if __name__ == "__main__":
    main()
