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
of the union and comes back (cycle check). Side-effecting nodes are barriers no region
crosses. A region whose program still exceeds a limit (registers) is split into consecutive
runs in graph order, each a valid region.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from dvm.lower import (
    CONST,
    EXPAND,
    POINTWISE,
    REDUCE,
    ROW,
    RULES,
    Emitter,
    Fact,
    LimitError,
    Rule,
    reduced_dims,
    rule_reason,
    unsupported_reason,
)
from dvm.program import MAX_INPUTS, MAX_INSTRS, MAX_OUTPUTS, Program

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
        return [_op_name(n) for n in self.nodes]

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


def _op_name(n: Node) -> str:
    t = n.target
    return getattr(t, "__name__", str(t)) if not isinstance(t, torch._ops.OpOverload) else str(t)


def _pad(shape: Shape, rank: int) -> Shape:
    if len(shape) == rank:
        return tuple(shape)
    return (1,) * (rank - len(shape)) + tuple(shape)


def _same(a: Shape, b: Shape) -> bool:
    if a == b:
        return True
    rank = max(len(a), len(b))
    return _pad(a, rank) == _pad(b, rank)


def broadcast(a: Shape, b: Shape) -> Shape | None:
    """Broadcast of two shapes, ``None`` when they do not broadcast."""
    if a == b:
        return tuple(a)
    rank = max(len(a), len(b))
    out = []
    for x, y in zip(_pad(a, rank), _pad(b, rank), strict=True):
        if x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            return None
    return tuple(out)


_numel = math.prod


_IMPURE: dict[Any, bool] = {}  # by id(target) (an OpOverload's hash is Python code)
_BY_FIRST_ARG = {  # wrappers whose side effect is the wrapped op's (their first argument)
    id(torch.ops.higher_order.auto_functionalized),
    id(torch.ops.higher_order.auto_functionalized_v2),
}


def is_barrier(n: Node) -> bool:
    """Whether ``n`` has a side effect (no region spans it; it keeps its place)."""
    if n.op != "call_function":
        return False
    key: Any = id(n.target)
    if key in _BY_FIRST_ARG and n.args:
        key = (key, id(n.args[0]))
    impure = _IMPURE.get(key)
    if impure is None:
        impure = _IMPURE[key] = n.is_impure()
    return impure


_RULES_BY_ID = {id(t): rule for t, rule in RULES.items()}


class _Analysis:
    """Per-node facts: domain shapes, cut edges, footprints (shape each node spans)."""

    def __init__(self, nodes: list[Node]) -> None:
        self.index: dict[Node, int] = {}
        self.fallbacks: list[tuple[Node, str]] = []
        self.facts: dict[Node, Fact | str] = {}  # each value's shape, dtype and size
        self.dshape: dict[Node, Shape] = {}
        self.cut: dict[Node, tuple[Node, ...]] = {}
        self.footprint: dict[Node, Shape] = {}
        self.cost: dict[Node, int] = {}
        self.segment: dict[Node, int] = {}
        self.args: dict[Node, list[Node]] = {}  # an analysed node's distinct tensor arguments
        index, segment, facts, rules = self.index, self.segment, self.facts, _RULES_BY_ID
        seg = 0
        for i, n in enumerate(nodes):
            index[n] = i
            segment[n] = seg
            if n.op != "call_function":
                continue
            rule = rules.get(id(n.target))
            if rule is None:  # our rules' ops have no side effects
                if is_barrier(n):
                    segment[n] = seg + 1
                    seg += 2
                else:  # getitem included: unsupported_reason says which case it is
                    self.fallbacks.append((n, unsupported_reason(n)))
                continue
            ops = n.all_input_nodes
            reason = rule_reason(n, rule, ops, facts)
            if reason is not None:
                self.fallbacks.append((n, reason))
                continue
            self._analyse(n, rule, ops)

    def view_of(self, p: Node, reader: Node) -> Shape:
        """The shape ``reader`` sees its operand ``p`` with."""
        shape = self.dshape.get(p)
        if shape is not None and p not in self.cut[reader]:
            return shape
        return self.facts[p][0]

    def _aligned(self, p: Node) -> bool:
        shape = self.dshape.get(p)
        return shape is None or shape is self.facts[p][0] or _same(shape, self.facts[p][0])

    def _analyse(self, n: Node, rule: Rule, ops: list[Node]) -> None:
        self.args[n] = ops
        facts = self.facts
        real = facts[n][0]
        kind = rule.kind
        cut: tuple[Node, ...] = ()
        self.cut[n] = cut  # view_of(p, n) reads it
        if kind == POINTWISE:
            big = [p for p in ops if facts[p][2] > 1]
            if all(self._aligned(p) for p in big):
                shape = foot = real  # the broadcast of its operands
            else:
                pairs = {
                    (_pad(facts[p][0], 8), _pad(self.dshape.get(p, facts[p][0]), 8)) for p in big
                }
                if len(pairs) == 1:
                    shape = self.dshape[big[0]]
                else:
                    cut = tuple(p for p in big if not self._aligned(p))
                    shape = real
                foot = None
        elif kind == REDUCE:
            x = n.args[0]
            if not self._aligned(x) and facts[x][2] > 1:
                cut = (x,)
            dims = reduced_dims(n)
            shape = tuple(1 if d in dims else s for d, s in enumerate(facts[x][0]))
            foot = None
        elif kind == ROW:  # its rows are the domain's: operands seen as they are
            cut = tuple(p for p in ops if facts[p][2] > 1 and not self._aligned(p))
            shape = foot = real
        elif kind == EXPAND:
            x = n.args[0]
            if not self._aligned(x):
                cut = (x,)
            shape, foot = real, None
        elif kind == CONST:
            shape, foot = real, None
        else:  # VIEW: same values
            shape, foot = self.view_of(n.args[0], n), None
        self.cut[n] = cut
        self.dshape[n] = shape
        if foot is None:
            foot = shape
            for p in ops:
                foot = broadcast(foot, self.view_of(p, n)) or foot
        self.footprint[n] = foot
        cost = rule.cost
        for a in n.args:
            if isinstance(a, (int, float)):
                cost += 1
        for a in n.kwargs.values():
            if isinstance(a, (int, float)):
                cost += 1
        self.cost[n] = cost


class _Group:
    __slots__ = (
        "big",
        "cost",
        "domain",
        "ext",
        "hi",
        "inputs",
        "lo",
        "members",
        "mset",
        "outputs",
        "partners",
        "seg",
    )

    def __init__(self, n: Node, a: _Analysis) -> None:
        self.members = [n]
        self.mset = {n}
        self.inputs = set(a.args[n])
        self.outputs = {n}
        self.ext = set(n.users)
        self.domain = a.footprint[n]
        self.big = _numel(self.domain)
        self.cost = a.cost[n]
        self.lo = self.hi = a.index[n]
        self.seg = a.segment[n]
        self.partners = set(a.cut[n])


def _storable(shape: Shape, domain: Shape) -> bool | None:
    """``False`` when an output of domain shape ``shape`` is stored full, ``True`` when
    row-reduced, ``None`` when the VM cannot store it over ``domain``."""
    padded = _pad(shape, len(domain))
    if padded == domain:
        return False
    if padded == (*domain[:-1], 1):
        return True
    return None


class _Clusterer:
    def __init__(self, gm: GraphModule) -> None:
        self.nodes = list(gm.graph.nodes)
        self.a = a = _Analysis(self.nodes)
        self.group: dict[Node, _Group] = {n: _Group(n, a) for n in a.dshape}
        for c, cut in a.cut.items():  # a cut edge keeps its ends apart both ways
            for p in cut:
                if p in self.group:
                    self.group[p].partners.add(c)

    def run(self) -> list[list[Node]]:
        group, args, cut = self.group, self.a.args, self.a.cut
        for c in self.nodes:
            gc = group.get(c)
            if gc is None:
                continue
            for p in args[c]:
                gp = group.get(p)
                merged = gp is not None and gp is not gc and p not in cut[c]
                if merged and self._try_merge(gp, gc):
                    gc = group[c]
        for p in self.nodes:  # siblings: regions reading one value load it once
            first = None
            for u in p.users:
                g = group.get(u)
                if g is None:
                    continue
                if first is None:
                    first = g
                elif g is not first and self._try_merge(first, g):
                    first = group[u]
        seen: dict[int, _Group] = {}
        for g in group.values():
            seen.setdefault(id(g), g)
        index = self.a.index.__getitem__
        return [sorted(g.members, key=index) for g in seen.values()]

    def _try_merge(self, x: _Group, y: _Group) -> bool:
        if x.seg != y.seg:
            return False
        if not (x.partners.isdisjoint(y.mset) and y.partners.isdisjoint(x.mset)):
            return False
        domain = x.domain
        if domain != y.domain:
            domain = broadcast(domain, y.domain)
            if domain is None or _numel(domain) != max(x.big, y.big):
                return False
        union = x.mset | y.mset
        inputs = (x.inputs | y.inputs) - union
        if len(inputs) > MAX_INPUTS:
            return False
        outputs = set()
        stores = 0
        dshape = self.a.dshape
        for o in (*x.outputs, *y.outputs):
            if union.issuperset(o.users):
                continue
            if _storable(dshape[o], domain) is None:
                return False
            if id(_alias_base(o, union).target) in _ALIASING:  # stored, a view of a value
                return False  # outside would be a copy: eager's view sees that value's updates
            if id(o.target) == _EXPAND_ID and _numel(dshape[o]) > _numel(dshape[o.args[0]]):
                return False  # stored, it would widen the domain: eager's expand is a view
            outputs.add(o)
            if not (id(o.target) in _ALIASING and o.args[0] in union):
                stores += 1
        if stores > MAX_OUTPUTS:
            return False
        cost = x.cost + y.cost
        if cost + len(inputs) + len(outputs) > MAX_INSTRS:
            return False
        if self._reaches(x, y, union) or self._reaches(y, x, union):
            return False
        big, small = (x, y) if len(x.members) >= len(y.members) else (y, x)
        big.members += small.members
        big.mset = union
        big.inputs = inputs
        big.outputs = outputs
        big.ext = (x.ext | y.ext) - union
        if domain is not big.domain:
            big.domain = domain
            big.big = _numel(domain)
        big.cost = cost
        big.lo, big.hi = min(x.lo, y.lo), max(x.hi, y.hi)
        big.partners = x.partners | y.partners
        for n in small.members:
            self.group[n] = big
        return True

    def _reaches(self, src: _Group, dst: _Group, union: set[Node]) -> bool:
        """Whether a path leaves ``src`` through a node outside ``union`` and enters ``dst``.
        Another region on the way runs as one unit: reaching any of its nodes reaches every
        node its outputs feed (two regions that each read the other's output would deadlock
        even though no node-level path leaves either and comes back)."""
        stack = [u for u in src.ext if u not in union]
        if not stack:
            return False
        index = self.a.index
        seen: set[Node] = set()
        crossed: set[_Group] = set()
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            g = self.group.get(x)
            if g is not None and len(g.members) > 1:
                if g in crossed or g.lo > dst.hi:
                    continue
                crossed.add(g)
                feeds = [u for m in g.members for u in m.users]
            elif index[x] > dst.hi:
                continue
            else:
                feeds = list(x.users)
            for u in feeds:
                if u in dst.mset:
                    return True
                if u not in union:
                    stack.append(u)
        return False


def build_region(members: list[Node], a: _Analysis) -> Region:
    """Lower ``members`` (graph order) to one region; ``ValueError`` (a :class:`LimitError`
    for the VM's limits) when they do not make one."""
    t0 = time.perf_counter()
    mset = set(members)
    domain: Shape = ()
    big = 1
    for n in members:
        foot = a.footprint[n]
        domain = broadcast(domain, foot)
        if domain is None:
            raise ValueError("members do not broadcast to one domain")
        big = max(big, _numel(foot))
    if _numel(domain) != big:
        raise ValueError(f"domain {domain} spans more than any member (an outer product)")
    domain = domain or (1,)  # 0-d values only (a scale worked out from a scalar): one element
    em = Emitter()
    env: dict[Node, int] = {}
    slots: dict[tuple[Node, Shape], int] = {}
    outputs: list[Node] = []
    slots_out: list[int] = []
    stored: dict[tuple[int, torch.dtype, bool], tuple[int, Node]] = {}  # slot, whose values
    out_dtypes: list[torch.dtype] = []
    reduced: list[bool] = []
    reader: Node = members[0]

    def resolve(x: object) -> int:
        if type(x) is not Node:
            return em.const(x)
        value = env.get(x)
        if value is None:  # read from outside: a load of the view the reader sees
            key = (x, a.view_of(x, reader))
            slot = slots.get(key)
            if slot is None:
                slot = slots[key] = len(slots)
            value = em.load(slot)
        return value

    for n in members:
        reader = n
        value = env[n] = _RULES_BY_ID[id(n.target)].emit(em, n, resolve)
        for u in n.users:
            if u not in mset:
                break
        else:
            continue
        red = _storable(a.dshape[n], domain)
        if red is None:
            raise ValueError(f"output {n.name} {a.dshape[n]} is neither {domain} nor row-reduced")
        key = (value, a.facts[n][1], red)
        base = _alias_base(n, mset)
        earlier = stored.get(key)
        if earlier is None or earlier[1] is not base:  # a view shares its base's output only
            earlier = stored[key] = (em.store(value), base)
            out_dtypes.append(key[1])
            reduced.append(red)
        outputs.append(n)
        slots_out.append(earlier[0])
    if not outputs:
        raise ValueError("no output")
    if len(slots) > MAX_INPUTS:
        raise LimitError(f"{len(slots)} inputs (the VM takes {MAX_INPUTS})")
    if em.n_outputs > MAX_OUTPUTS:
        raise LimitError(f"{em.n_outputs} outputs (the VM takes {MAX_OUTPUTS})")
    if len(em.code) > MAX_INSTRS:
        raise LimitError(f"{len(em.code)} instructions (the VM takes {MAX_INSTRS})")
    program = em.program(len(slots))
    return Region(
        nodes=list(members),
        input_nodes=[k[0] for k in slots],
        input_views=[k[1] for k in slots],
        outputs=outputs,
        output_slots=slots_out,
        domain=domain,
        program=program,
        out_dtypes=out_dtypes,
        reduced=reduced,
        build_us=(time.perf_counter() - t0) * 1e6,
    )


_ALIASING = {  # by id(target), as _RULES_BY_ID
    id(aten.alias.default),
    id(aten.view.default),
    id(aten._unsafe_view.default),
    id(aten.reshape.default),
    id(aten.unsqueeze.default),
    id(aten.squeeze.default),
    id(aten.squeeze.dim),
    id(aten.squeeze.dims),
    id(aten.expand.default),
}


def _alias_base(n: Node, members: set[Node]) -> Node:
    """The member whose values ``n`` holds: ``n``, or through views inside the region the
    value they view (eager returns a view of it; another node of equal values is a tensor of
    its own)."""
    while id(n.target) in _ALIASING and n.args[0] in members:
        n = n.args[0]
    return n


_EXPAND_ID = id(aten.expand.default)
_CASTS = {id(aten._to_copy.default), id(torch.ops.prims.convert_element_type.default)}
ALONE = "a single op: eager runs it in one pass, the VM would only add its call's cost"
MIN_OPS = 2
"""Default ``min_ops``: a region must stand for at least this many eager kernels."""


def _passes(region: Region) -> int:
    """The eager kernels ``region`` stands for: its pointwise ops, reductions, row ops
    (softmax...) and casts (views and constants cost eager nothing)."""
    return sum(
        1
        for n in region.nodes
        if _RULES_BY_ID[id(n.target)].kind in _WORK or id(n.target) in _CASTS
    )


_WORK = (POINTWISE, REDUCE, ROW)


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


def cluster(gm: GraphModule, *, min_ops: int = MIN_OPS) -> Clustering:
    """Regions of ``gm`` (nodes need ``meta["val"]``) and the call nodes left to eager with
    the reason. A region standing for fewer than ``min_ops`` eager kernels (pointwise ops,
    reductions, casts) is left to eager: one op alone runs faster there."""
    t0 = time.perf_counter()
    c = _Clusterer(gm)
    groups = c.run()
    regions: list[Region] = []
    fallbacks = list(c.a.fallbacks)
    notes: list[str] = []
    for members in sorted(groups, key=lambda m: c.a.index[m[0]]):
        mset = set(members)
        if not any(u not in mset for n in members for u in n.users):
            continue  # dead code: left as it is
        try:
            parts = [build_region(members, c.a)]
        except ValueError as e:
            notes.append(f"split {len(members)} nodes from {members[0].name}: {e}")
            parts, dropped = _split(members, c.a)
            fallbacks.extend(dropped)
        for r in parts:
            work = _passes(r)
            if work >= min_ops:
                regions.append(r)
            elif work:
                fallbacks.extend((n, ALONE) for n in r.nodes)
    return Clustering(regions, fallbacks, (time.perf_counter() - t0) * 1e6, notes)
