"""Cluster: group VM-able nodes of an aten FX graph into regions; Split: cut a region where
the VM's limits are hit.

Every value in a region is a tensor broadcastable to the region's *domain* (its last dim the
row). A node's *domain shape* is its shape as the region sees it: its own shape, except after
a reduction without keepdim or a squeeze, where the dropped dims stay as size 1 (``(B, R)``
summed over the row is ``(B,)``, seen as ``(B, 1)``). An operand is *aligned* when both agree;
an op that would mix a non-aligned operand with other tensors is cut from it (the edge
becomes a region boundary and the value is loaded with its real shape).

Regions grow by merging along producer->consumer edges when the union: has one domain that
some member already spans (no outer-product blow-up), stores only full or row-reduced
outputs, keeps within MAX_INPUTS/MAX_OUTPUTS/MAX_INSTRS, and leaves no path that goes out
of the union and comes back (cycle check). Nodes that may have a side effect
(:func:`spore.side_effects.has_side_effect`: impure ops, method and module calls, callables
not known to be pure) are barriers no region crosses. A region whose program still exceeds a
limit (registers) is split into consecutive runs in graph order, each a valid region.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from dvm import _analysis, _emitter
from dvm.lower import (
    CONST,
    EXPAND,
    FLOAT_LIMITS,
    POINTWISE,
    REDUCE,
    ROW,
    RULES,
    VIEW_OPS,
    Emitter,
    Fact,
    op_name,
    reduced_dims,
    rule_reason,
    unsupported_reason,
    value_fact,
)
from dvm.program import DTYPE_CODES, MAX_DIMS, MAX_INPUTS, MAX_INSTRS, MAX_OUTPUTS, Program
from spore.side_effects import has_side_effect

Shape = tuple[int, ...]
aten = torch.ops.aten


@dataclass
class Region:
    """One VM region: its nodes (graph order), the values it reads (``inputs``, each loaded
    as ``input_views[i]`` of ``input_nodes[i]``) and writes (``outputs``), its domain and
    program; ``reduced[i]`` when output ``i`` is row-reduced; ``build_us`` the time lowering
    and building the program took."""

    nodes: list[Node]
    input_nodes: list[Node]
    input_views: list[Shape]
    outputs: list[Node]
    output_slots: list[int]
    domain: Shape
    program: Program
    out_dtypes: list[torch.dtype]
    reduced: list[bool]
    build_us: float

    @property
    def ops(self) -> list[str]:
        return [op_name(n.target) for n in self.nodes]

    @property
    def unique_inputs(self) -> list[Node]:
        return list(dict.fromkeys(self.input_nodes))


@dataclass
class Clustering:
    """The regions of a graph, the nodes left to eager with why, and the time it took."""

    regions: list[Region]
    fallbacks: list[tuple[Node, str]]
    cluster_us: float = 0.0
    notes: list[str] = field(default_factory=list)


_EAGER: dict[int, tuple[bool, str]] = {}  # _eager's results by id(target), read first by the C


def _eager(n: Node) -> tuple[bool, str]:
    """For a call node without a VM rule (a method or module call too): whether it may have a
    side effect (:func:`spore.side_effects.has_side_effect`: no region spans it), and why it
    stays eager; remembered in ``_EAGER`` where the op alone decides and lives as long as the
    process (an aten op, ``operator.getitem``; not a wrapper such as ``auto_functionalized``,
    whose answer is the wrapped op's, nor a user's function, which may be freed and its id
    reused)."""
    barrier = has_side_effect(n)
    fact = (barrier, _side_effect_reason(n) if barrier else unsupported_reason(n))
    if isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem:
        _EAGER[id(n.target)] = fact
    return fact


_OPS = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)


def _side_effect_reason(n: Node) -> str:
    """Why a node with a side effect stays eager and splits the regions around it."""
    what = {
        "call_method": f"a method call ({n.target}) may mutate its arguments",
        "call_module": f"a module call ({n.target}) may mutate its arguments or state",
    }.get(n.op)
    if what is None and isinstance(n.target, _OPS):
        what = f"op {op_name(n.target)} has a side effect (it mutates or draws random numbers)"
    if what is None:
        what = f"{op_name(n.target)} is not known to be pure (it may mutate its arguments)"
    return f"{what}: kept in place, no region spans it"


def _analysis_fast_path() -> tuple:
    """What ``csrc/analysis.c`` works out without asking :mod:`dvm.lower`: FakeTensor (whose
    device it reads from its fields), the ids of the pointwise ops that may give a bool
    result, the rules' checks it works out where they pass, MAX_ROW, and the reason it gives
    where the view check refuses."""
    from torch._subclasses.fake_tensor import FakeTensor

    from dvm import lower
    from dvm.program import MAX_ROW

    checks = (
        lower._check_reduce,
        lower._check_view,
        lower._check_to_copy,
        lower._check_div_mode,
        lower._check_bitwise,
        lower._row_check(1),
        lower._row_check(2),
    )
    return (
        FakeTensor,
        frozenset(id(t) for t in lower._BOOL_OUT),
        checks,
        MAX_ROW,
        lower.VIEW_REFUSAL,
    )


_RULES_BY_ID = {id(t): rule for t, rule in RULES.items()}
_ALIASING_OPS = (*VIEW_OPS, aten.expand.default)  # results that are views of their first argument
_analysis.setup(
    _RULES_BY_ID,
    torch.Tensor,
    torch.device("cpu"),
    DTYPE_CODES,
    FLOAT_LIMITS,
    torch.bool,
    MAX_DIMS,
    (POINTWISE, REDUCE, ROW, EXPAND, CONST),
    (_eager, _EAGER, rule_reason, value_fact, reduced_dims),
    (_ALIASING_OPS, aten.expand.default, MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS),
    _analysis_fast_path(),
    Node,
)


class _Analysis:
    """Per-node facts: domain shapes, cut edges, footprints (shape each node spans). Worked out
    in C (``csrc/analysis.c``), which asks :mod:`dvm.lower` why the VM refuses a node;
    :meth:`groups` merges the analysed nodes there too."""

    def __init__(self, nodes: list[Node]) -> None:
        self.index: dict[Node, int] = {}
        self.fallbacks: list[tuple[Node, str]] = []
        self.facts: dict[Node, Fact | str] = {}  # each value's shape, dtype and size
        self.dshape: dict[Node, Shape] = {}
        self.cut: dict[Node, tuple[Node, ...]] = {}
        self.footprint: dict[Node, Shape] = {}
        self.cost: dict[Node, int] = {}
        self.segment: dict[Node, int] = {}
        self.args: dict[Node, tuple[Node, ...]] = {}  # an analysed node's distinct tensor arguments
        self.nodes = nodes
        self.missing_meta: bool = _analysis.run(self, nodes)  # a node lacks its fake value

    def groups(self) -> list[tuple[list[Node], Sequence[Node], int]]:
        """The analysed nodes merged into groups that make regions, ordered by their first
        node: along producer->consumer edges, then siblings (groups reading one value load it
        once). Each is ``(live, dead, work)``: its members (graph order) whose values something
        reads (a node outside the group, or a live member), the others (dead code), and how
        many live ones stand for an eager kernel (:func:`_passes`)."""
        return _analysis.merge(self, self.nodes, _WORK_IDS)


_emitter.setup_regions(
    _RULES_BY_ID,
    Node,
    Region,
    Emitter,
    _analysis.domain,
    _analysis.storable,
    _ALIASING_OPS,
    (MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS),
)
build_region = _emitter.build_region
"""``build_region(members, a)``: ``members`` (graph order) lowered to one :class:`Region` by C
(``csrc/emitter.c``) calling each member's rule; ``ValueError`` (a
:class:`~dvm.lower.LimitError` for the VM's limits) when they do not make one."""


_CASTS = {id(aten._to_copy.default), id(torch.ops.prims.convert_element_type.default)}
ALONE = "a single op: eager runs it in one pass, the VM would only add its call's cost"
DEAD = "dead code: nothing reads its value; left as it is, for eager to run"
NO_WORK = "views and constants only: eager runs them without a kernel, nothing to fuse"
MIN_OPS = 2
"""Default ``min_ops``: a region must stand for at least this many eager kernels."""


def _passes(region: Region) -> int:
    """The eager kernels ``region`` stands for: its pointwise ops, reductions, row ops
    (softmax...) and casts (views and constants cost eager nothing)."""
    return sum(id(n.target) in _WORK_IDS for n in region.nodes)


_WORK_IDS = frozenset(  # the ids of the ops that stand for an eager kernel
    {id(t) for t, rule in RULES.items() if rule.kind in (POINTWISE, REDUCE, ROW)} | _CASTS
)


def _split(members: list[Node], a: _Analysis) -> tuple[list[Region], list[tuple[Node, str]]]:
    """Consecutive runs of ``members`` (graph order), each as long as still builds."""
    regions: list[Region] = []
    dropped: list[tuple[Node, str]] = []
    rest = list(members)
    while rest:
        best: Region | None = None
        lo, hi = 1, len(rest)
        while lo <= hi:  # longest prefix that builds (binary search, then shrink)
            mid = (lo + hi) // 2
            try:
                best, lo = build_region(rest[:mid], a), mid + 1
            except ValueError:
                hi = mid - 1
        if best is None:
            dropped.append((rest[0], "cannot form a region alone"))
            rest = rest[1:]
            continue
        regions.append(best)
        rest = rest[len(best.nodes) :]
    return regions, dropped


def _split_parts(
    members: list[Node],
    a: _Analysis,
    error: ValueError,
    notes: list[str],
    fallbacks: list[tuple[Node, str]],
) -> list[tuple[Region, int]]:
    """A group that does not build as one region (``error``) split by :func:`_split`, each
    part with the eager kernels it stands for; the split noted in ``notes``, the nodes no part
    takes in ``fallbacks``."""
    notes.append(f"split {len(members)} nodes from {members[0].name}: {error}")
    split, dropped = _split(members, a)
    fallbacks.extend(dropped)
    return [(r, _passes(r)) for r in split]


def cluster(
    gm: GraphModule,
    *,
    min_ops: int = MIN_OPS,
    fill_meta: Callable[[], object] | None = None,
) -> Clustering:
    """Regions of ``gm`` (nodes need ``meta["val"]``) and the call nodes left to eager with
    the reason; ``fill_meta()``, when given, is called to give the nodes their fake values when
    a placeholder or a call something reads has none, and the graph analysed again. A region
    standing for fewer than ``min_ops`` eager kernels (pointwise ops, reductions, casts) is
    left to eager: one op alone runs faster there. Dead code (nodes nothing reads) is in no
    region, a fallback run as the graph has it."""
    t0 = time.perf_counter()
    return _cluster(_analysis.nodes(gm.graph), min_ops, fill_meta, (), t0)


def _cluster(
    nodes: list[Node],
    min_ops: int,
    fill_meta: Callable[..., object] | None,
    fill_args: tuple,
    t0: float,
) -> Clustering:
    """:func:`cluster` of the graph's ``nodes``, ``fill_meta(*fill_args)`` called where it
    calls ``fill_meta()``, its ``cluster_us`` timed from ``t0``: what
    :func:`dvm.compile.compile_graph` calls, without a closure made for each graph."""
    a = _Analysis(nodes)
    if a.missing_meta and fill_meta is not None:
        filling = time.perf_counter()
        fill_meta(*fill_args)
        t0 += time.perf_counter() - filling  # cluster_us times the clustering, not the fill
        a = _Analysis(nodes)
    regions: list[Region] = []
    fallbacks = list(a.fallbacks)
    notes: list[str] = []
    for members, dead, work in a.groups():
        if dead:  # dead code stays out of regions, run as it is
            fallbacks += [(n, DEAD) for n in dead]
        if not members:
            continue
        try:
            parts = ((build_region(members, a), work),)
        except ValueError as e:
            parts = _split_parts(members, a, e, notes, fallbacks)
        for r, work in parts:
            if work >= min_ops:
                regions.append(r)
            else:
                fallbacks += [(n, ALONE if work else NO_WORK) for n in r.nodes]
    return Clustering(regions, fallbacks, (time.perf_counter() - t0) * 1e6, notes)
