"""Instructions and simulated cache misses of dvm's cold compile of each benchmark chain.

A compile right after tracing runs with cold caches: its time is mostly the code and Python
objects it reaches for the first time (README, Figures). Timing that is noisy; counting it is
not. This runs the compile under valgrind's callgrind with a simulated cache (a 32 MiB last
level, ``--LL=33554432,16,64``): for each chain, a fresh copy of its aten graph is compiled
once after a 64 MiB write has evicted the simulated caches, with the instrumentation on only
around that ``compile_graph`` (a small C extension built here with the system compiler makes
callgrind's client requests). Printed per chain: instructions (Ir) and last-level misses for
code (IL), data reads (DLr) and writes (DLw). ``--phases`` splits the compile into the calls
that ``compile_graph``'s Python path makes (the node list, the analysis, the merging, the
regions' build, their runners, the schedule, the result; its C path, ``dvm._analysis.compile``,
makes the same calls without Python between them), one count each. torch runs at one thread
(a worker thread would run inside the counted window). About 1 run in 3 shows one chain
100-150k instructions and 900-2000 misses above its usual count (not the garbage collector,
not understood yet): run again rather than believe it. Needs valgrind (with its headers) and a
C compiler; 30-60 s.

    python packages/dvm/tools/cold_misses.py [--chains silu,rms_norm] [--phases]
    python packages/dvm/tools/cold_misses.py --keep DIR  # keeps the files for callgrind_annotate
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_TOGGLE = r"""
#include <Python.h>
#include <valgrind/callgrind.h>
static PyObject* on(PyObject* m, PyObject* a) { CALLGRIND_START_INSTRUMENTATION; Py_RETURN_NONE; }
static PyObject* off(PyObject* m, PyObject* a) { CALLGRIND_STOP_INSTRUMENTATION; Py_RETURN_NONE; }
static PyObject* zero(PyObject* m, PyObject* a) { CALLGRIND_ZERO_STATS; Py_RETURN_NONE; }
static PyObject* dump(PyObject* m, PyObject* name) {
    const char* s = PyUnicode_AsUTF8(name);
    if (s == NULL) return NULL;
    CALLGRIND_DUMP_STATS_AT(s);
    Py_RETURN_NONE;
}
static PyMethodDef methods[] = {{"on", on, METH_NOARGS, 0}, {"off", off, METH_NOARGS, 0},
                                {"zero", zero, METH_NOARGS, 0}, {"dump", dump, METH_O, 0}, {0}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cgtoggle", 0, -1, methods};
PyMODINIT_FUNC PyInit_cgtoggle(void) { return PyModule_Create(&module); }
"""

CHAINS = ("silu", "gelu_tanh", "rms_norm", "softmax")
VALGRIND = ("--tool=callgrind", "--instr-atstart=no", "--cache-sim=yes", "--LL=33554432,16,64")


def _inner(chains: list[str], phases: bool) -> None:
    """Under callgrind: each chain's compile counted (one dump per chain, or per phase)."""
    import cgtoggle
    import torch

    torch.set_num_threads(1)
    from dvm import _analysis, _executor, benchmarks, cluster
    from dvm.compile import CompiledGraph, RegionRunner, compile_graph

    sweep = torch.zeros((64 << 20) // 4)
    prepared = {}
    for chain in chains:
        gm, inputs = benchmarks._aten_graph(chain)
        min_ops = benchmarks.CHAINS[chain].min_ops
        for _ in range(3):  # code quickened, lazy set-up done: as in a process that compiled before
            compile_graph(copy.deepcopy(gm), inputs, min_ops=min_ops)
        prepared[chain] = (gm, inputs, min_ops)
    cgtoggle.on()
    for chain in chains:
        gm, inputs, min_ops = prepared[chain]
        graph = copy.deepcopy(gm)
        sweep.add_(1.0)
        cgtoggle.zero()
        if not phases:
            compiled = compile_graph(graph, inputs, min_ops=min_ops)
            cgtoggle.dump(chain)  # before the result is freed
            del compiled
            continue
        nodes = _analysis.nodes(graph.graph)
        cgtoggle.dump(f"{chain}:1 nodes")
        a = cluster._Analysis(nodes)
        cgtoggle.dump(f"{chain}:2 analysis")
        groups = a.groups()
        cgtoggle.dump(f"{chain}:3 merge")
        regions = [cluster.build_region(live, a) for live, _, _ in groups if live]
        clustering = cluster.Clustering(regions, list(a.fallbacks))
        cgtoggle.dump(f"{chain}:4 build")
        runners = [RegionRunner(r, k) for k, r in enumerate(clustering.regions)]
        cgtoggle.dump(f"{chain}:5 runners")
        run = _executor.schedule(graph, nodes, runners)
        cgtoggle.dump(f"{chain}:6 schedule")
        compiled = CompiledGraph(run, runners, clustering, 0.0, 0.0)
        cgtoggle.dump(f"{chain}:7 result")
        del compiled
    cgtoggle.off()


def _report(folder: Path) -> None:
    """One line per callgrind dump: its name, instructions and last-level misses."""
    rows = []
    for path in folder.glob("out.*"):
        text = path.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        summary = re.search(r"^summary: (.*)$", text, re.M)
        if name is None or summary is None:
            continue
        v = [int(x) for x in summary.group(1).split()] + [0] * 9
        rows.append((name.group(1), v[0], v[6], v[7], v[8]))
    if not rows:
        raise SystemExit(f"callgrind wrote no counts (see {folder}/log)")
    print(f"{'':18} {'Ir':>8} {'IL':>6} {'DLr':>6} {'DLw':>6} {'misses':>7}")
    for name, ir, il, dlr, dlw in sorted(rows):
        print(f"{name:18} {ir:8} {il:6} {dlr:6} {dlw:6} {il + dlr + dlw:7}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chains", default=",".join(CHAINS), help="comma-separated chains")
    parser.add_argument("--phases", action="store_true", help="one count per compile phase")
    parser.add_argument("--keep", type=Path, help="a folder to leave callgrind's files in")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    chains = [c for c in args.chains.split(",") if c]
    if args.inner:
        _inner(chains, args.phases)
        return
    from dvm import benchmarks

    unknown = [c for c in chains if c not in benchmarks.CHAINS]
    if unknown or not chains:
        raise SystemExit(f"unknown chains {unknown}; choose from {', '.join(benchmarks.CHAINS)}")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH (install valgrind and its headers)")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="dvm-cold-misses-"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("out.*"):  # an earlier run's counts are not this one's
        old.unlink()
    import _cext  # beside this script

    _cext.build(folder, "cgtoggle", _TOGGLE)
    path = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    cmd = ["valgrind", *VALGRIND, f"--callgrind-out-file={folder}/out"]
    cmd += [sys.executable, __file__, "--inner", "--chains", ",".join(chains)]
    cmd += ["--phases"] if args.phases else []
    print(f"counting under callgrind ({len(chains)} chains, ~15 s each)...", file=sys.stderr)
    with open(folder / "log", "w") as log:
        done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"the counted run failed (exit {done.returncode}; see {folder}/log)")
    _report(folder)
    if args.keep is None:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
