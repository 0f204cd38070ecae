"""``compile_graph``: an aten FX graph with each region replaced by one VM call, the rest eager.

A region's runner checks its guards (each input's shape, dtype and device as compiled; no
input needing grad while grad mode is on) and runs the program on the VM; when a guard fails
or the VM raises, it runs the region's own aten nodes eagerly instead and records why — the
result is never wrong and the call never crashes for lack of VM support.
"""

from __future__ import annotations

import functools
import heapq
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from dvm import _analysis, _executor, cluster
from dvm.cluster import (
    _WORK_IDS,
    ALONE,
    DEAD,
    MIN_OPS,
    NO_WORK,
    Clustering,
    Region,
    _Analysis,
    _cluster,
    _split_parts,
)
from dvm.executor import Executor, RegionCall
from dvm.program import Program, run_reference
from spore.side_effects import has_side_effect

Strides = tuple[int, ...]


@dataclass(frozen=True)
class _ReferenceLaunch:
    """A bound reference program with :class:`dvm.vm.Launch`'s ``guarded``, as the runner
    calls it."""

    run: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    guards: list[tuple[torch.Size, torch.dtype]]

    def guarded(
        self, args: Sequence[Any], results: tuple[tuple[int, torch.Size | None], ...]
    ) -> tuple[torch.Tensor, ...] | None:
        if _guard_failure(args, self.guards) is not None:
            return None
        outs = self.run(args)
        return tuple(outs[k] if v is None else outs[k].view(v) for k, v in results)


class _Reference:
    """The reference executor in :class:`dvm.vm.Kernel`'s shape (``bind``, then the bound
    program's ``guarded`` with the args): where the C++ VM is not built."""

    def __init__(self, program: Program, out_dtypes: list[torch.dtype], reduced: list[bool]):
        self.program, self.out_dtypes, self.reduced = program, out_dtypes, reduced

    def bind(
        self,
        domain: tuple[int, ...],
        args: Sequence[torch.Tensor],
        operands: Sequence[tuple[int, Sequence[int]]],
        out_shapes: Sequence[Sequence[int]],
        *,
        out_strides: Sequence[Strides | None] | None = None,
    ) -> _ReferenceLaunch:
        layouts = out_strides or [None] * len(out_shapes)

        def run(args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            inputs = [args[i].view(view) for i, view in operands]
            outs = run_reference(self.program, inputs, domain, self.out_dtypes, self.reduced)
            return [
                (
                    o
                    if s is None
                    else torch.empty_strided(o.shape, s, dtype=o.dtype, device=o.device).copy_(o)
                ).view(shape)
                for o, shape, s in zip(outs, out_shapes, layouts, strict=True)
            ]

        return _ReferenceLaunch(run, [(a.shape, a.dtype) for a in args])


def _out_layouts(region: Region) -> list[Strides | None] | None:
    """Each VM output's strides over the domain where the traced value is laid out densely
    but otherwise than contiguously (e.g. RoPE on a transposed query), its shape the domain's
    up to size-1 dims: the graph after the region may rely on them (views, fused attention).
    An expanded value (a stride 0) is stored contiguous: every view of it is a view of that
    too. ``None`` when every output is contiguous."""
    layouts: list[Strides | None] = [None] * len(region.out_dtypes)
    for node, k in zip(region.outputs, region.output_slots, strict=True):
        val = node.meta["val"]
        if not val.is_contiguous() and not region.reduced[k] and _dense(val.shape, val.stride()):
            layouts[k] = _over_domain(val, region.domain)
    return None if all(s is None for s in layouts) else layouts


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` covers its memory once without gaps: its
    dims of size above 1, ordered by stride, are contiguous (torch's
    ``is_non_overlapping_and_dense`` on concrete sizes, without its symbolic-size machinery,
    which takes 70-160 µs on a fake tensor right after tracing)."""
    if math.prod(shape) < 2:
        return True
    expected = 1
    for size, stride in sorted(zip(shape, strides, strict=True), key=lambda p: p[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def _over_domain(val: torch.Tensor, domain: tuple[int, ...]) -> Strides | None:
    """``val``'s strides over ``domain`` when its shape is the domain's up to size-1 dims
    (those take stride 0: only index 0 is read), else ``None``."""
    if val.shape == domain:
        return tuple(val.stride())
    own = [(n, st) for n, st in zip(val.shape, val.stride(), strict=True) if n != 1]
    if [size for size, _ in own] != [size for size in domain if size != 1]:
        return None
    strides = iter(stride for _, stride in own)
    return tuple(next(strides) if size != 1 else 0 for size in domain)


def _select_executor() -> tuple[Callable[..., Any], str]:
    """The C++ VM (``dvm.vm.Kernel``, a program encoded once) when it is built, else the
    reference executor. A ``DVM_ISA`` this machine cannot run is an error (``ValueError``),
    not a silent switch to the reference executor."""
    try:
        from dvm import _lib, vm

        _lib.library()  # raises ImportError when no build fits this machine
    except (ImportError, OSError):
        return _Reference, "reference"
    return vm.Kernel, "vm"


PREPARE, EXECUTOR = _select_executor()


def _direct_preparation() -> tuple[Any, Callable[[Region], tuple[Any, list[Node], Any]] | None]:
    """``dvm.vm.Kernel`` and ``dvm._launcher.prepare`` set up for the build in use (a region's
    encoding, binding and output layouts in one C call) where the VM is built, else ``None``
    twice: the runner prepares so while ``PREPARE`` is that ``Kernel``."""
    if EXECUTOR != "vm":
        return None, None
    from torch._subclasses.fake_tensor import FakeTensor

    from dvm import _launcher, _lib, vm
    from dvm.program import REDUCTIONS

    level = _lib.library()[1]
    _launcher.setup_regions(
        _lib.run_address(level),
        _lib.max_row(level),
        REDUCTIONS,
        vm._CASTS,
        vm.without_redundant_casts,
        (Node, FakeTensor, Region, Program),  # whose objects prepare() reads directly
    )
    return vm.Kernel, _launcher.prepare


_KERNEL, _PREPARE_REGION = _direct_preparation()


_NAMES: dict[int, str] = {}
"""Each runner's name by its number, formatted once (formatting is cold code at compile)."""


class RegionRunner:
    """Callable standing in for one region in the rewritten graph: inputs are the region's
    distinct input values, the result is the tuple of its outputs."""

    vm_calls = 0
    eager_calls = 0

    def __init__(self, region: Region, number: int) -> None:
        self.region = region
        name = _NAMES.get(number) or _NAMES.setdefault(number, f"dvm_region_{number}")
        self.__name__ = self.__qualname__ = name
        t0 = time.perf_counter()
        if PREPARE is _KERNEL:
            self._guarded, self._inputs, self._results = _PREPARE_REGION(region)
        else:
            self._prepare(region)
        self.prepare_us = (time.perf_counter() - t0) * 1e6

    @functools.cached_property
    def fallback_reasons(self) -> dict[str, int]:
        """How many calls ran eagerly for each reason (made at the first one asked for)."""
        return {}

    def _prepare(self, region: Region) -> None:
        """The preparation of ``dvm._launcher.prepare`` through ``PREPARE``'s ``bind`` (the
        reference executor, or a stand-in for the C++ VM's ``Kernel``)."""
        inputs = region.unique_inputs
        self._inputs = inputs
        position = {n: i for i, n in enumerate(inputs)}
        # each VM output is allocated in the shape of the first graph output it holds; another
        # graph output of the same VM output (a view of it) is a view of that, a tensor of its
        # own as eager's view is
        first: dict[int, Node] = {}
        results = []
        for node, k in zip(region.outputs, region.output_slots, strict=True):
            first.setdefault(k, node)
            shape = None if first[k] is node else torch.Size(node.meta["val"].shape)
            results.append((k, shape))
        self._results = tuple(results)
        kernel = PREPARE(region.program, region.out_dtypes, region.reduced)
        launch = kernel.bind(
            region.domain,
            [n.meta["val"] for n in inputs],
            [
                (position[n], view)
                for n, view in zip(region.input_nodes, region.input_views, strict=True)
            ],
            [first[k].meta["val"].shape for k in range(len(region.out_dtypes))],
            out_strides=_out_layouts(region),
        )
        self._guarded = launch.guarded

    @property
    def compile_us(self) -> float:
        """Lowering, building and preparing this region's program, in µs."""
        return self.region.build_us + self.prepare_us

    def guard(self, args: Sequence[Any]) -> str | None:
        """Why ``args`` cannot run on the compiled program, ``None`` when they can."""
        vals = (n.meta["val"] for n in self._inputs)
        return _guard_failure(args, [(v.shape, v.dtype) for v in vals])

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        try:
            outs = self._guarded(args, self._results)
        except Exception as e:
            reason = f"VM raised {type(e).__name__}: {e}"
        else:
            if outs is not None:
                self.vm_calls += 1
                return outs
            reason = self.guard(args) or "the VM's guard refused the inputs"
        self.eager_calls += 1
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        return self.eager(*args)

    def eager(self, *args: Any) -> tuple[Any, ...]:
        """The region's aten nodes run one by one (the fallback)."""
        env: dict[Node, Any] = dict(zip(self._inputs, args, strict=True))
        for n in self.region.nodes:
            a = map_arg(n.args, env.__getitem__)
            k = map_arg(n.kwargs, env.__getitem__)
            env[n] = n.target(*a, **k)
        return tuple(env[o] for o in self.region.outputs)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # the arg types a launch takes


def _guard_failure(
    args: Sequence[Any], guards: Sequence[tuple[torch.Size, torch.dtype]]
) -> str | None:
    """Why ``args`` cannot run on a program compiled for ``guards`` (each input's shape and
    dtype), ``None`` when they can: the reasons for the checks ``dvm._launcher`` makes."""
    grad = torch.is_grad_enabled()
    for i, (t, (shape, dtype)) in enumerate(zip(args, guards, strict=True)):
        if not isinstance(t, torch.Tensor):
            return f"input {i} is {type(t).__name__}, not a tensor"
        if type(t) not in _PLAIN_TENSORS:
            return (
                f"input {i} is a {type(t).__name__}, a tensor subclass: its own methods could "
                f"misstate the memory the VM reads"
            )
        if t.shape != shape:
            return f"input {i} has shape {tuple(t.shape)}, compiled for {tuple(shape)}"
        if t.dtype != dtype:
            return f"input {i} has dtype {t.dtype}, compiled for {dtype}"
        if not t.is_cpu or t.layout is not torch.strided:
            return f"input {i} is a {t.device} {t.layout} tensor; the VM runs on dense CPU ones"
        if t.is_neg():
            return f"input {i} is a lazily negated view (e.g. z.conj().imag); the VM reads memory"
        if grad and t.requires_grad:
            return f"input {i} requires grad under grad mode (the VM has no autograd)"
    return None


@dataclass
class CompiledGraph:
    """A compiled graph: call it like the original ``GraphModule``, or :meth:`boxed`.
    ``regions`` run on the VM; ``fallbacks`` are the call nodes left to eager with the reason;
    ``run`` runs it (every node eagerly, in graph order, when the compile failed); times in
    µs."""

    run: Executor
    runners: list[RegionRunner]
    clustering: Clustering
    total_us: float
    schedule_us: float
    executor: str = field(default=EXECUTOR)
    eager_runs: int = 0
    """Calls that ran the whole graph eagerly, counted by whoever runs it so
    (:class:`dvm.specialize.Specializing` past its ``compiles``)."""

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def boxed(self, args: list[Any]) -> Any:
        """Run on ``args`` and clear that list (AOT autograd's boxed calling convention), so
        that each input is freed after its last use (:meth:`dvm.executor.Executor.boxed`)."""
        return self.run.boxed(args)

    @property
    def regions(self) -> list[Region]:
        return [r.region for r in self.runners]

    @property
    def fallbacks(self) -> list[tuple[Node, str]]:
        return self.clustering.fallbacks

    @property
    def vm_calls(self) -> int:
        return sum(r.vm_calls for r in self.runners)

    @property
    def eager_calls(self) -> int:
        """Calls that ran a region, or the whole graph (``eager_runs``), eagerly."""
        return self.eager_runs + sum(r.eager_calls for r in self.runners)


def eager_graph(gm: GraphModule, why: str) -> CompiledGraph:
    """``gm`` run eagerly as it is, by an :class:`Executor` (called boxed, it frees each input
    after its last use), every call node a fallback with ``why``."""
    t0 = time.perf_counter()
    run = Executor(gm, list(gm.graph.nodes))
    return CompiledGraph(run, [], _all_eager(gm, why), (time.perf_counter() - t0) * 1e6, 0.0)


def _all_eager(gm: GraphModule, why: str) -> Clustering:
    """No region: every call node of ``gm`` left to eager with ``why``."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return Clustering([], [(n, why) for n in calls], 0.0, [why])


class _NoFakeValues(Exception):
    """Fake tensor propagation failed (``__cause__``): raised to the caller, not run eagerly."""


def _ensure_meta(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Fake values for the graph's nodes, which the analysis found missing (a node nothing
    reads, such as an ``_assert_scalar``, needs none); :class:`_NoFakeValues` if that fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    except Exception as e:
        raise _NoFakeValues from e


def _native_compile() -> Callable[[GraphModule, Any, int, float], CompiledGraph | None] | None:
    """``dvm._analysis.compile`` set up where the runners prepare in C (the VM is built):
    :func:`compile_graph`'s common case in one call, ``None`` where a node lacks its fake value
    (then the Python path fills the values); ``None`` itself without the VM."""
    if _PREPARE_REGION is None:
        return None
    tables = {k: type(v) is list for k, v in vars(_Analysis([])).items()}
    for own in ("nodes", "missing_meta"):  # its attributes besides the tables
        del tables[own]
    _analysis.setup_compile(
        _Analysis,
        tables,
        cluster,  # its build_region looked up at each call, as _cluster's is
        _PREPARE_REGION,
        _executor,  # its schedule looked up at each call, as _compiled's is
        RegionRunner,
        Clustering,
        CompiledGraph,
        _WORK_IDS,
        (DEAD, ALONE, NO_WORK),
        _NAMES,
        _split_parts,
        _reordered_executor,
        _unprepared,
        EXECUTOR,
    )
    return _analysis.compile


def _reordered_executor(
    gm: GraphModule, nodes: list[Node], runners: list[RegionRunner]
) -> Executor:
    """The schedule where ``dvm._executor.schedule`` gives none (see :func:`_moved`)."""
    return Executor(gm, _moved(nodes, runners))


def _schedule(gm: GraphModule, runners: list[RegionRunner], nodes: list[Node]) -> Executor:
    """The graph (``nodes``, its nodes in order) with every region one call of its runner, the
    other nodes as they are, in an order that respects data dependencies and keeps side
    effects where they were."""
    run = _executor.schedule(gm, nodes, runners)  # the common case, in C
    return run if run is not None else _reordered_executor(gm, nodes, runners)


def _moved(nodes: list[Node], runners: list[RegionRunner]) -> list[Node | RegionCall]:
    """The order :func:`_schedule` takes where ``dvm._executor.in_place`` gives none (and
    ``dvm._executor.schedule`` no Executor)."""
    order = _before_readers(nodes, runners)
    return order if order is not None else _reordered(nodes, runners)


def _before_readers(
    nodes: list[Node], runners: list[RegionRunner]
) -> list[Node | RegionCall] | None:
    """The graph order with each region called just before the first node outside it that
    reads one of its values, or where its last node was when none comes earlier; ``None``
    when a value a region called earlier than its last node reads is made after that point,
    or by a region called later (then :func:`_reordered`). Regions span no side effect, so
    running a region's nodes together at that point changes nothing else. (What
    ``dvm._executor.in_place`` gives when it gives an order, at more cost.)"""
    index = {n: i for i, n in enumerate(nodes)}
    owner: dict[Node, int] = {}
    for k, runner in enumerate(runners):
        for n in runner.region.nodes:
            owner[n] = k
    keys: list[tuple[int, int]] = []  # each region's (node it is called before, last node)
    moved: list[int] = []  # the regions called before their last node
    for k, runner in enumerate(runners):
        members = runner.region.nodes
        last = max(map(index.__getitem__, members))
        at = last + 1
        for n in members:
            for u in n.users:
                if index[u] < at and owner.get(u) != k:
                    at = index[u]
        keys.append((at, last))
        if at <= last:
            moved.append(k)
    for k in moved:  # a region called where its last node was reads only values made before
        for n in runners[k].region.nodes:
            for p in n.all_input_nodes:
                j = owner.get(p, -1)
                if j != k and (keys[j] >= keys[k] if j >= 0 else index[p] >= keys[k][0]):
                    return None
    before: dict[int, list[RegionRunner]] = {}
    for k in sorted(range(len(runners)), key=keys.__getitem__):
        before.setdefault(keys[k][0], []).append(runners[k])
    order: list[Node | RegionCall] = []
    for i, n in enumerate(nodes):
        calls = before.get(i)
        if calls:
            order += [RegionCall(r, r._inputs, r.region.outputs) for r in calls]
        if n not in owner:
            order.append(n)
    return order


def _reordered(nodes: list[Node], runners: list[RegionRunner]) -> list[Node | RegionCall]:
    """A topological order of the regions and the other nodes, closest to the graph's
    (regions ordered by their first node), side effects kept in place."""
    index = {n: i for i, n in enumerate(nodes)}
    owner: dict[Node, int] = {}
    for k, runner in enumerate(runners):
        for n in runner.region.nodes:
            owner[n] = k
    units: list[Any] = []  # a Node, or a region number
    unit_of: dict[Node, int] = {}
    region_unit: dict[int, int] = {}
    for n in nodes:
        if n in owner:
            k = owner[n]
            if k not in region_unit:
                region_unit[k] = len(units)
                units.append(k)
            unit_of[n] = region_unit[k]
        else:
            unit_of[n] = len(units)
            units.append(n)
    members = [units[u] if isinstance(units[u], Node) else None for u in range(len(units))]
    deps: list[set[int]] = [set() for _ in units]
    key = [0] * len(units)
    last_barrier_unit = -1
    since_barrier: list[int] = []
    for u, unit in enumerate(units):
        group = [unit] if isinstance(unit, Node) else runners[unit].region.nodes
        key[u] = min(index[n] for n in group)
        for n in group:
            for p in n.all_input_nodes:
                if unit_of[p] != u:
                    deps[u].add(unit_of[p])
        impure = members[u] is not None and has_side_effect(members[u])
        if impure or (members[u] is not None and members[u].op == "output"):
            deps[u].update(since_barrier)
            last_barrier_unit = u
            since_barrier = []
        else:
            if last_barrier_unit >= 0:
                deps[u].add(last_barrier_unit)
            since_barrier.append(u)
    users: list[list[int]] = [[] for _ in units]
    for u, ds in enumerate(deps):
        for d in ds:
            users[d].append(u)
    waiting = [len(ds) for ds in deps]
    heap = [(key[u], u) for u in range(len(units)) if waiting[u] == 0]
    heapq.heapify(heap)
    order: list[Node | RegionCall] = []
    while heap:
        _, u = heapq.heappop(heap)
        unit = units[u]
        if isinstance(unit, Node):
            order.append(unit)
        else:
            runner = runners[unit]
            order.append(RegionCall(runner, runner._inputs, runner.region.outputs))
        for v in users[u]:
            waiting[v] -= 1
            if waiting[v] == 0:
                heapq.heappush(heap, (key[v], v))
    if len(order) < len(units):
        raise RuntimeError("dvm: the scheduled graph lost nodes (a dependency cycle)")
    return order


def compile_graph(
    gm: GraphModule, example_inputs: Sequence[Any], *, min_ops: int = MIN_OPS
) -> CompiledGraph:
    """``gm`` with its VM-able regions running on the VM and the rest as eager aten; regions
    of fewer than ``min_ops`` eager kernels stay eager (see :func:`dvm.cluster.cluster`)."""
    # an exact int skips isinstance, whose check against bool (an int's subclass) is slower
    wrong = type(min_ops) is not int and (isinstance(min_ops, bool) or not isinstance(min_ops, int))
    if wrong or min_ops < 1:
        raise ValueError(f"min_ops must be an int >= 1 (1 runs every region), got {min_ops!r}")
    t0 = time.perf_counter()
    failed_fill: BaseException | None = None
    try:
        try:
            graph = gm._graph  # the field gm.graph's getter (a Python call) reads
        except AttributeError:  # a GraphModule keeping its graph otherwise
            graph = gm.graph
        native = _COMPILE is not None and PREPARE is _KERNEL  # the runners prepare in C
        compiled = None
        if native:  # values read without a getter's __torch_function__ lookup each time
            with _SUBCLASS_TF_OFF():
                compiled = _COMPILE(gm, graph, min_ops, t0)
        if compiled is None:
            compiled = _compiled(gm, graph, example_inputs, min_ops, t0)
    except _NoFakeValues as e:
        failed_fill = e.__cause__  # raised below, outside this handler: its own cause kept
    except Exception as e:  # a compiler bug must not break the user's program: run eagerly
        why = f"dvm could not compile this graph ({type(e).__name__}: {e}); it runs eagerly"
        warnings.warn(why, RuntimeWarning, stacklevel=2)
        failed = eager_graph(gm, why)
        failed.total_us = (time.perf_counter() - t0) * 1e6
        return failed
    if failed_fill is not None:
        raise failed_fill
    return compiled


def _compiled(
    gm: GraphModule, graph: Any, example_inputs: Sequence[Any], min_ops: int, t0: float
) -> CompiledGraph:
    """:func:`compile_graph`'s work in Python (what ``dvm._analysis.compile`` does in C), its
    times from ``t0``: where the VM is not built, or a node lacks its fake value."""
    nodes = _analysis.nodes(graph)
    clustering = _cluster(nodes, min_ops, _ensure_meta, (gm, example_inputs), t0)
    runners = _runners(clustering)
    t1 = time.perf_counter()
    run = _schedule(gm, runners, nodes)
    t2 = time.perf_counter()
    return CompiledGraph(run, runners, clustering, (t2 - t0) * 1e6, (t2 - t1) * 1e6)


def _runners(clustering: Clustering) -> list[RegionRunner]:
    """Each region's runner, numbered in order; a region whose runner raises is taken out of
    ``clustering`` and handed to :func:`_unprepared`."""
    runners: list[RegionRunner] = []
    kept: list[Region] = []
    for region in clustering.regions:
        try:
            runners.append(RegionRunner(region, len(runners)))
        except Exception as e:
            _unprepared(region, e, clustering.fallbacks, clustering.notes)
        else:
            kept.append(region)
    clustering.regions[:] = kept
    return runners


def _unprepared(
    region: Region, error: Exception, fallbacks: list[tuple[Node, str]], notes: list[str]
) -> None:
    """A region whose runner raised (a bug in dvm, or a limit its build missed): a warning,
    its nodes left to eager with why; the graph's other regions still run on the VM."""
    why = (
        f"dvm could not prepare a region ({type(error).__name__}: {error}); its "
        f"{len(region.nodes)} nodes run eagerly"
    )
    warnings.warn(why, RuntimeWarning, stacklevel=2)
    fallbacks.extend((n, why) for n in region.nodes)
    notes.append(why)


_COMPILE = _native_compile()
# Around the common case: a tensor getter on a subclass (a FakeTensor) looks
# __torch_function__ up on it at every read unless subclass handling is off; modes still apply.
# Not around the Python path, whose fill of missing values propagates the user's inputs.
_SUBCLASS_TF_OFF = torch._C.DisableTorchFunctionSubclass
