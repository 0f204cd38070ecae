"""Cluster and Split on small aten graphs: merging, cycle avoidance, limits, reduction and
domain boundaries; every compiled graph still equals eager."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import warnings

import pytest
import torch
from torch.fx import Node
from torch.fx.experimental.proxy_tensor import make_fx

from dvm import _emitter
from dvm import cluster as cl
from dvm.cluster import ALONE, DEAD, NO_WORK, _Analysis, build_region, cluster
from dvm.compile import MIN_OPS, compile_graph
from dvm.lower import NATIVE, NATIVE_DTYPES, Emitter, Form, LimitError, unsupported_reason
from dvm.program import MAX_INPUTS, MAX_INSTRS, MAX_OUTPUTS, MAX_REGS, Op, Program
from spore.side_effects import has_side_effect

aten = torch.ops.aten


def _compiled(fn, *args, min_ops=1):  # structure tests: regions of one op count too
    gm = make_fx(fn, tracing_mode="fake")(*args)
    compiled = compile_graph(gm, list(args), min_ops=min_ops)
    got, want = compiled(*args), fn(*args)
    for g, w in zip(_seq(got), _seq(want), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert compiled.vm_calls == len(compiled.regions)
    return compiled


def _seq(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _names(region):
    return [n.target for n in region.nodes]


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_chain_is_one_region():
    c = _compiled(lambda x, w: torch.sigmoid(x * w + 1).exp() - x, _x(5, 9), _x(9, seed=1))
    (region,) = c.regions
    assert len(region.nodes) == 5
    assert region.domain == (5, 9)
    assert len(region.unique_inputs) == 2
    assert len(region.outputs) == 1


def test_softmax_with_its_reductions_is_one_region():
    def softmax(x):
        e = (x - x.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    c = _compiled(softmax, _x(4, 3, 17))
    (region,) = c.regions
    assert aten.amax.default in _names(region)
    assert aten.sum.dim_IntList in _names(region)


def test_no_cycle_through_an_eager_node():
    # y -> sum over dim 0 (eager) -> w, and y -> w: y and w in one region would need the eager
    # sum both before (it reads y) and after (w reads it) the region
    def fn(x):
        y = x.exp()
        z = y.sum(0, keepdim=True)
        return y * z

    c = _compiled(fn, _x(6, 7))
    assert len(c.regions) == 2
    assert [n.target for n, _ in c.fallbacks] == [aten.sum.dim_IntList]
    first, second = c.regions
    assert aten.exp.default in _names(first)
    assert aten.mul.Tensor in _names(second)


def test_split_at_the_output_limit():
    def fn(x):
        return tuple((x * k).sin() for k in range(MAX_OUTPUTS + 3))

    c = _compiled(fn, _x(3, 5))
    assert len(c.regions) >= 2
    assert all(r.program.n_outputs <= MAX_OUTPUTS for r in c.regions)
    assert sum(len(r.outputs) for r in c.regions) == MAX_OUTPUTS + 3


def test_split_at_the_input_limit():
    n = MAX_INPUTS + 4
    xs = [_x(2, 6, seed=k) for k in range(n)]

    def fn(*ts):
        total = ts[0].exp()
        for t in ts[1:]:
            total = total + t
        return total

    c = _compiled(fn, *xs)
    assert len(c.regions) >= 2
    assert all(r.program.n_inputs <= MAX_INPUTS for r in c.regions)


def test_split_when_registers_run_out(registers_run_out, same_as_python_path):
    """Merged whole, then split when built (``dvm.cluster._split_parts``, which the C compile
    calls too): noted, and the C compile's result is the Python path's."""
    fn = registers_run_out
    gm = make_fx(fn, tracing_mode="fake")(_x(3, 4))
    clustering = cluster(gm)
    assert any("registers" in note for note in clustering.notes)
    assert len(clustering.regions) >= 2
    assert all(r.program.n_regs <= MAX_REGS for r in clustering.regions)
    same_as_python_path(compile_graph(gm, [_x(3, 4)]), gm, [_x(3, 4)], min_ops=MIN_OPS)
    _compiled(fn, _x(3, 4))


def test_reduction_without_keepdim_is_a_boundary_for_real_shapes():
    # s has shape (B,) but lives as (B, 1) in x's domain; s + y (y of shape (B,)) cannot be
    # expressed in that domain, so the add starts a region of its own
    def fn(x, y):
        s = x.sum(-1)
        return (s + y).exp(), (s * 2).sigmoid()

    c = _compiled(fn, _x(5, 8), _x(5, seed=1))
    add_region = next(r for r in c.regions if aten.add.Tensor in _names(r))
    assert aten.sum.dim_IntList not in _names(add_region)
    assert add_region.domain == (5,)
    sum_region = next(r for r in c.regions if aten.sum.dim_IntList in _names(r))
    assert aten.sigmoid.default in _names(sum_region)  # s * 2 alone is fine (a scalar)
    assert sum_region.reduced == [True] * len(sum_region.reduced)


@pytest.mark.parametrize(
    ("shapes", "fn"),
    [
        (((1, 1, 16), (8,)), lambda x, y: (x.amax(-1), (y - x.amax(-1)).exp())),
        (((1, 5), (7,)), lambda x, a: (x.sum(-1).exp(), x.sum(-1) * a)),
    ],
)
def test_a_batch_1_reduction_read_in_a_narrower_domain(shapes, fn):
    """A row reduction of leading size-1 dims keeps its input's rank in its own domain
    ((1, 1, 1)); read by a region over another row ((1, 8)), its view had more dims than that
    domain: the launcher refused it and the whole graph ran eagerly, with a warning."""
    inputs = [_x(*shape, seed=k) for k, shape in enumerate(shapes)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = _compiled(fn, *inputs, min_ops=1)
    assert c.regions
    assert all(len(view) <= len(r.domain) for r in c.regions for view in r.input_views)
    torch.testing.assert_close(c(*inputs), fn(*inputs))


def test_no_outer_product_domain_from_siblings():
    def fn(a, b, s):
        return (a * s).exp(), (b * s).exp()

    c = _compiled(fn, _x(6, 1), _x(1, 7, seed=1), _x(1, 1, seed=2))
    assert sorted(r.domain for r in c.regions) == [(1, 7), (6, 1)]


def test_siblings_reading_one_input_share_a_region():
    c = _compiled(lambda x: (x.exp(), x.sin(), x.cos()), _x(4, 4))
    (region,) = c.regions
    assert region.program.n_inputs == 1
    assert region.program.n_outputs == 3


def test_an_output_narrower_than_the_domain_stays_out():
    # w * 2 (shape (1, R)) is a graph output: a region over (B, R) cannot store it
    def fn(x, w):
        w2 = w * 2
        return x * w2, w2

    c = _compiled(fn, _x(5, 6), _x(1, 6, seed=1))
    mul_w = next(r for r in c.regions if len(r.nodes) == 1 and r.domain == (1, 6))
    assert mul_w.outputs[0].name.startswith("mul")


def test_an_expanded_output_stays_a_view_of_the_region_output():
    """Returned, ``z.expand`` stays eager's view of z: in the region it widened the domain, so
    the VM computed z 8 times over and wrote it out in full."""

    def fn(x, y):
        return ((x * y).sigmoid() + 1).expand(8, 3, 16)

    def inside(x, y):  # an expand the region reads itself is fused as before
        return (((x * y).sigmoid() + 1).expand(2, 3, 16) * y).exp()

    x, y = _x(3, 16), _x(3, 16, seed=1)
    (region,) = _compiled(fn, x, y).regions
    assert region.domain == (3, 16)
    wide = _compiled(fn, x, y)(x, y)
    assert wide.stride() == (0, 16, 1)
    assert wide.untyped_storage().nbytes() == 3 * 16 * 4
    (region,) = _compiled(inside, x, y).regions
    assert region.domain == (2, 3, 16)
    assert aten.expand.default in _names(region)


def test_fallback_nodes_are_listed_with_reasons():
    def fn(x):
        return (x.exp().cumsum(-1) * 2).double().sin()

    c = _compiled(fn, _x(3, 4))
    reasons = {str(n.target): why for n, why in c.fallbacks}
    assert "no VM lowering" in reasons["aten.cumsum.default"]
    assert "float64" in reasons["aten.sin.default"]
    assert len(c.regions) == 2  # exp, and the mul (+ the cast to float64 stays eager)


def test_a_region_of_one_op_stays_eager():
    def fn(x, w):
        a = x.exp()  # alone between two eager ops: nothing to fuse
        b = a.cumsum(-1)  # no VM lowering
        c = b.to(torch.bfloat16) * w  # a cast and a mul: two passes in eager, one on the VM
        return a.sum(0), c.view(-1)  # views cost eager nothing

    x, w = _x(3, 4), _x(4, seed=1).to(torch.bfloat16)
    c = _compiled(fn, x, w, min_ops=2)
    assert [r.ops for r in c.regions] == [["aten._to_copy.default", "aten.mul.Tensor"]]
    assert {str(n.target): why for n, why in c.fallbacks}["aten.exp.default"] == ALONE
    assert len(_compiled(fn, x, w, min_ops=1).regions) == 2


def test_a_region_of_views_only_is_listed_as_left_to_eager():
    """A group of views and constants (no kernel in eager) was in no region and missing from
    the fallbacks."""

    def fn(x):
        return x.view(-1).cumsum(0).view(2, 10).unsqueeze(0)

    gm = make_fx(fn, tracing_mode="fake")(_x(4, 5))
    c = compile_graph(gm, [_x(4, 5)], min_ops=1)
    assert c.regions == []
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n for n, _ in c.fallbacks] == calls  # every call node is accounted for
    assert [(n.target, why) for n, why in c.fallbacks if why == NO_WORK] == [
        (aten.unsqueeze.default, NO_WORK)
    ]


def test_dead_code_is_listed_as_left_to_eager():
    """A group whose values nothing reads was left to eager (run as the graph has it) but
    missing from the fallbacks."""

    def fn(x, y):
        (y * 3).exp()  # dead: no region, run by eager
        return x.sin() + 1

    c = _compiled(fn, _x(4, 5), _x(3, 7, seed=1))
    assert [r.ops for r in c.regions] == [["aten.sin.default", "aten.add.Tensor"]]
    assert [n.target for n, _ in c.fallbacks] == [aten.mul.Tensor, aten.exp.default]
    assert all(why.startswith("dead code: nothing reads its value") for _, why in c.fallbacks)


def test_dead_code_merged_with_live_nodes_stays_out_of_the_region():
    """Dead nodes merged into a live region were in its ``ops`` and computed by its program
    (never stored); they are now fallbacks like dead code of its own, run as the graph has
    them, and the region's ops, program and eager fallback are its live nodes."""

    def fn(x):
        a = x.sin()
        (a * 3).exp()  # dead, reading a region value
        return a + 1

    c = _compiled(fn, _x(4, 5))
    (region,) = c.regions
    assert region.ops == ["aten.sin.default", "aten.add.Tensor"]
    program = region.program.disassemble()
    assert "exp" not in program
    assert "mul" not in program
    assert [(n.target, why) for n, why in c.fallbacks] == [
        (aten.mul.Tensor, DEAD),
        (aten.exp.default, DEAD),
    ]
    assert [n.name for n in region.outputs] == ["sin", "add"]  # sin stored for the mul
    x = _x(4, 5)
    torch.testing.assert_close(c.runners[0].eager(x)[1], fn(x))


def test_two_regions_never_read_each_others_outputs():
    # found by hypothesis: {amax, add} and {abs_2, amax_1, add_1} each pass the node-level
    # cycle check, but each reads the other's output (amax -> add_1, amax_1 -> add)
    def fn(x):
        m = x.amax(-1)
        a = x.abs()
        ma = a.amax(-1)
        return x + ma, m + a, ma

    c = _compiled(fn, _x(2, 1))
    assert not any("could not compile" in why for _, why in c.fallbacks), c.fallbacks
    assert len(c.regions) >= 2
    assert sum(hasattr(t, "region") for t in c.run.targets) == len(c.regions)


def test_the_analysis_remembers_eager_ops_by_op_and_a_wrapper_by_what_it_wraps():
    """Ops without a VM rule: the analysis asks Python once per op (a side effect, or why it
    stays eager) and then reads what it remembered; an auto_functionalized node is asked
    each time, its answer being the wrapped op's. The segments and reasons are the same with
    the memory empty or full."""
    from torch.fx import Graph

    from dvm import cluster as dc

    wrapper = torch.ops.higher_order.auto_functionalized
    g = Graph()
    x = g.placeholder("x")
    nodes = [
        g.call_function(aten.mm.default, (x, x)),
        g.call_function(wrapper, (torch.ops.aten.add_.Tensor,), {"self": x, "other": x}),
        g.call_function(wrapper, (torch.ops.inductor.accumulate_grad_.default,), {}),
        g.call_function(aten.mm.default, (x, x)),
        g.call_function(torch.ops.inductor.accumulate_grad_.default, (x, x)),
        g.call_function(aten.mm.default, (x, x)),
    ]
    g.output(nodes[-1])
    graph_nodes = list(g.nodes)
    dc._EAGER.clear()
    cold = _Analysis(graph_nodes)
    assert set(dc._EAGER) == {id(aten.mm.default), id(torch.ops.inductor.accumulate_grad_.default)}
    warm = _Analysis(graph_nodes)
    for a in (cold, warm):
        assert [a.segment[n] for n in nodes] == [0, 0, 1, 2, 3, 4]  # two side effects
        assert [n for n, _ in a.fallbacks] == nodes  # the side effects with their reason
        reasons = dict(a.fallbacks)
        assert reasons[nodes[0]] == unsupported_reason(nodes[0])
        assert "accumulate_grad_.default has a side effect" in reasons[nodes[4]]
        assert "no region spans it" in reasons[nodes[2]]
    assert warm.fallbacks == cold.fallbacks


def test_build_region_refuses_members_of_no_one_domain():
    """Members whose footprints broadcast only to a domain none of them spans (an outer
    product), or to none at all, make no region: ``ValueError``, and the members that do
    share one build it."""
    gm = make_fx(lambda a, b, c: (a.exp(), b.exp(), c.exp()), tracing_mode="fake")(
        _x(4, 1), _x(1, 5), _x(3)
    )
    a = _Analysis(list(gm.graph.nodes))
    exp_a, exp_b, exp_c = [n for n in gm.graph.nodes if n.target == aten.exp.default]
    with pytest.raises(ValueError, match=r"domain \(4, 5\) spans more than any member"):
        build_region([exp_a, exp_b], a)
    with pytest.raises(ValueError, match="do not broadcast to one domain"):
        build_region([exp_b, exp_c], a)
    assert build_region([exp_a], a).domain == (4, 1)


def _traced(fn, *args):
    """``fn``'s aten graph, its analysis and its call nodes (graph order)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return gm, _Analysis(list(gm.graph.nodes)), calls


def test_build_region_stores_a_value_once_per_dtype_reduction_and_alias_base():
    """A view returned beside its base shares the base's output; a clone of the same value, a
    row-reduced value and a value of another dtype each get their own (a view's own dtype too:
    read from the analysis' facts)."""

    def fn(x):
        y = x.exp()
        return y, aten.alias(y), y.clone(), y.sum(-1, keepdim=True), aten.alias(y)

    _, a, (exp, alias, clone, total, alias_bf16) = _traced(fn, _x(4, 8))
    shape, _, size = a.facts[alias_bf16]
    a.facts[alias_bf16] = (shape, torch.bfloat16, size)
    region = build_region([exp, alias, clone, total, alias_bf16], a)
    assert region.outputs == [exp, alias, clone, total, alias_bf16]
    assert region.output_slots == [0, 0, 1, 2, 3]
    assert region.out_dtypes == [torch.float32, torch.float32, torch.float32, torch.bfloat16]
    assert region.reduced == [False, False, True, False]
    assert region.program.n_outputs == 4
    assert region.domain == (4, 8)
    assert region.build_us > 0


def test_build_region_makes_the_region_its_dataclass_init_makes():
    """``build_region`` makes a :class:`~dvm.cluster.Region` without calling it: the same
    fields, set in the same order, as its ``__init__`` gives; a region class it cannot make so
    (a ``__post_init__``, a function) is called."""
    _, a, calls = _traced(lambda x: (x.exp() * 2).sin(), _x(4, 8))
    region = build_region(calls, a)
    assert type(region) is cl.Region
    fields = {f.name: getattr(region, f.name) for f in dataclasses.fields(region)}
    assert list(vars(region)) == list(vars(cl.Region(**fields))) == list(fields)
    assert region == cl.Region(**fields)

    made = []

    @dataclasses.dataclass
    class Checked(cl.Region):
        def __post_init__(self):
            made.append(self)

    limits = (MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS)
    given = [cl._RULES_BY_ID, Node, Checked, Emitter, cl._analysis.domain]
    given += [cl._analysis.storable, cl._ALIASING_OPS, limits]
    try:
        for region_class in (Checked, lambda *fields: made.append(fields) or Checked(*fields)):
            given[2] = region_class
            _emitter.setup_regions(*given)
            made.clear()
            checked = build_region(calls, a)
            assert type(checked) is Checked
            assert made[-1] is checked
            assert {**vars(checked), "build_us": 0.0} == {**fields, "build_us": 0.0}
    finally:
        given[2] = cl.Region
        _emitter.setup_regions(*given)
    assert type(build_region(calls, a)) is cl.Region


def test_build_region_calls_a_region_dataclass_whose_init_is_its_own():
    """A dataclass keeps an ``__init__`` written in its class: ``build_region`` calls such a
    region class rather than make it bare, skipping what that ``__init__`` does."""
    _, a, calls = _traced(lambda x: (x.exp() * 2).sin(), _x(4, 8))

    @dataclasses.dataclass
    class Own(cl.Region):
        def __init__(self, *fields):
            for f, v in zip(dataclasses.fields(self), fields, strict=True):
                setattr(self, f.name, v)
            self.by_init = True

    limits = (MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS)
    given = [cl._RULES_BY_ID, Node, Own, Emitter, cl._analysis.domain]
    given += [cl._analysis.storable, cl._ALIASING_OPS, limits]
    try:
        _emitter.setup_regions(*given)
        region = build_region(calls, a)
        assert type(region) is Own
        assert region.by_init
    finally:
        given[2] = cl.Region
        _emitter.setup_regions(*given)
    assert type(build_region(calls, a)) is cl.Region


def test_region_and_program_classes_with_a_constructor_of_their_own_are_called():
    """A region dataclass or a Program class that a constructor of its own makes (a dict's,
    here) is called: made bare, with object's constructor, its own state would be unset (a
    crash at its first use as a dict)."""
    _, a, calls = _traced(lambda x: (x.exp() * 2).sin(), _x(4, 8))

    @dataclasses.dataclass(eq=False)
    class DictRegion(cl.Region, dict):
        pass

    class DictProgram(Program, dict):
        @classmethod
        def built(cls, n_inputs, n_outputs, n_regs, encoded):
            program = dict.__new__(cls)
            vars(program).update(
                n_inputs=n_inputs, n_outputs=n_outputs, n_regs=n_regs, _encoded=encoded
            )
            return program

    limits = (MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS)
    given = [cl._RULES_BY_ID, Node, DictRegion, Emitter, cl._analysis.domain]
    given += [cl._analysis.storable, cl._ALIASING_OPS, limits]
    try:
        _emitter.setup_regions(*given)
        _emitter.setup(LimitError, DictProgram.built, MAX_REGS)
        region = build_region(calls, a)
        assert type(region) is DictRegion
        assert type(region.program) is DictProgram
        region["used"] = region.program["used"] = 1  # each a working dict
        assert region["used"] == region.program["used"] == 1
    finally:
        given[2] = cl.Region
        _emitter.setup_regions(*given)
        _emitter.setup(LimitError, Program.built, MAX_REGS)
    assert type(build_region(calls, a).program) is Program


def test_build_region_refuses_an_analysis_whose_dshape_is_no_dict():
    _, a, calls = _traced(lambda x: (x.exp() * 2).sin(), _x(4, 8))
    a.dshape = list(a.dshape.items())
    with pytest.raises(TypeError, match="dshape must be a dict, not list"):
        build_region(calls, a)


def test_a_rule_table_emptied_while_a_node_is_asked_about_is_not_read():
    """The analysis reads each rule's kind and check once, into a table (holding the rule)
    emptied when full; code run while a node is asked about (a dtype's ``__hash__`` in the
    limits lookup) may empty it, and the node's rule is read before that (else a NULL check,
    a crash)."""
    base = next(r for r in cl._RULES_BY_ID.values() if r.kind == "pointwise" and r.check is None)
    fact = cl.value_fact(torch.empty(4))
    added = []

    def graph():
        def fn(x):
            return -x

        added.append(fn)
        cl._RULES_BY_ID[id(fn)] = dataclasses.replace(base)
        g = torch.fx.Graph()
        x = g.placeholder("x")
        g.output(g.call_function(fn, (x,)))
        return list(g.nodes), cl._RULES_BY_ID[id(fn)]

    def analysis(nodes, dtype):
        a = object.__new__(_Analysis)
        a.index, a.fallbacks, a.dshape, a.cut = {}, [], {}, {}
        a.footprint, a.cost, a.segment, a.args = {}, {}, {}, {}
        a.facts = {nodes[0]: fact, nodes[1]: (fact[0], dtype, *fact[2:])}
        a.nodes = nodes
        return a

    emptied = []

    class Dtype:
        def __hash__(self):  # fresh rules read until the table lets go of the outer one's
            held = sys.getrefcount(rule)
            for _ in range(1000):
                if emptied or sys.getrefcount(rule) < held:
                    break
                inner, _ = graph()
                cl._analysis.run(analysis(inner, torch.float32), inner)
            else:
                emptied.append(True)
            return hash(torch.float32)

    try:
        outer, rule = graph()
        a = analysis(outer, Dtype())
        cl._analysis.run(a, outer)
        assert not emptied  # the table was emptied while the outer node was asked about
        assert a.fallbacks == []  # its rule's check (None) passed
    finally:
        for fn in added:
            del cl._RULES_BY_ID[id(fn)]


def test_build_region_of_many_members():
    """A region of more members than ``build_region`` looks through one by one (it makes a
    set of them then) lowers as a small one does: 40 chained ops, read outside only at the
    end, make one output."""

    def fn(x):
        for k in range(40):
            x = x.exp() if k % 2 else x * 0.5
        return x

    _, a, calls = _traced(fn, _x(4, 8))
    region = build_region(calls, a)
    assert region.outputs == [calls[-1]]
    assert region.nodes == calls
    assert region.program.n_outputs == 1
    assert len(region.input_nodes) == 1
    assert region.program.n_inputs == 1


def test_build_region_loads_each_view_an_input_is_read_with_once():
    """An operand outside the region is loaded as the reader sees it: its domain shape, or its
    real shape over a cut edge; one input per (node, view), in the order first read."""

    def fn(x, y):
        return (x.exp() * x).sin() + y  # y makes the domain (2, 4, 8)

    _, a, (exp, mul, sin, add) = _traced(fn, _x(4, 8), _x(2, 4, 8, seed=1))
    x, y = [n for n in a.facts if n.op == "placeholder"]
    a.dshape[x] = torch.Size([1, 4, 8])
    a.cut[mul] = (x,)
    region = build_region([exp, mul, sin, add], a)
    assert region.input_nodes == [x, x, y]
    assert region.input_views == [(1, 4, 8), (4, 8), (2, 4, 8)]
    loads = [ins.a for ins in region.program.instrs if ins.op == 0]
    assert loads == [0, 1, 2]
    assert region.unique_inputs == [x, y]


def test_build_region_errors():
    """Members that make no region raise ValueError (LimitError past a VM limit) with the
    reason; wrong arguments raise TypeError."""

    def fn(x, w):
        y = w * 2  # (1, 8): read outside, it cannot be stored over (4, 8)
        return x * y, y

    _, a, (mul_w, mul_x) = _traced(fn, _x(4, 8), _x(1, 8, seed=1))
    with pytest.raises(
        ValueError, match=r"^output mul torch.Size\(\[1, 8\]\) is neither \(4, 8\) nor row-reduced$"
    ):
        build_region([mul_w, mul_x], a)
    assert build_region([mul_x], a).input_nodes == [mul_x.args[0], mul_w]
    _, a, (exp, sin) = _traced(lambda x: x.exp().sin(), _x(4, 8))
    sin.users.clear()  # nothing reads it any more: no member is an output
    with pytest.raises(ValueError, match=r"^no output$"):
        build_region([exp, sin], a)
    xs = [_x(4, seed=k) for k in range(MAX_INPUTS + 1)]
    _, a, calls = _traced(lambda *xs: sum(xs[1:], xs[0]), *xs)
    with pytest.raises(
        LimitError, match=rf"^{MAX_INPUTS + 1} inputs \(the VM takes {MAX_INPUTS}\)"
    ):
        build_region(calls, a)
    _, a, calls = _traced(lambda x: [x + k for k in range(MAX_OUTPUTS + 1)], _x(4))
    with pytest.raises(LimitError, match=rf"^{MAX_OUTPUTS + 1} outputs \(the VM takes"):
        build_region(calls, a)
    _, a, calls = _traced(
        lambda x: functools.reduce(lambda v, _: v.exp(), range(MAX_INSTRS), x), _x(4)
    )
    with pytest.raises(LimitError, match=rf"^{MAX_INSTRS + 2} instructions \(the VM takes"):
        build_region(calls, a)
    with pytest.raises(ValueError, match="no members"):
        build_region([], a)
    with pytest.raises(TypeError, match="build_region"):
        build_region(calls, a, a)
    with pytest.raises(TypeError, match="members must be a sequence"):
        build_region(1, a)


@pytest.fixture
def python_rules():
    """Every node lowered by its Python rule (none by ``csrc/emitter.c``'s forms)."""
    _emitter.setup_native({}, NATIVE_DTYPES)
    yield
    _emitter.setup_native(NATIVE, NATIVE_DTYPES)


def test_build_region_hands_the_rules_a_resolve(monkeypatch, python_rules):
    """The rules' ``r``: a node argument's value (a constant for a non-node, the value of a
    member lowered before, else a load), ``r.computed(node)`` whether a member made it; wrong
    arguments raise TypeError."""
    _, a, (exp, sin) = _traced(lambda x: x.exp().sin(), _x(4, 8))
    (x,) = exp.args
    seen = []

    def emit(em, n, r):
        seen.append((r.computed(x), r.computed(exp), r(2.0), r(x), r(x)))
        if n is sin:
            seen.append(r(exp))
            with pytest.raises(TypeError):
                r()
            with pytest.raises(TypeError):
                r(x, x)
            with pytest.raises(TypeError):
                r("2")
            with pytest.raises(TypeError):
                r.computed([])
        return em.unary(Op.EXP, r(n.args[0]))

    rule = cl._RULES_BY_ID[id(aten.exp.default)]
    for op in (aten.exp.default, aten.sin.default):
        monkeypatch.setitem(cl._RULES_BY_ID, id(op), dataclasses.replace(rule, emit=emit))
    region = build_region([exp, sin], a)
    assert seen[0] == (False, False, 0, 1, 1)  # a constant, then the load of x
    assert seen[1] == (False, True, 0, 1, 1)
    assert seen[2] == 2  # exp's value
    assert region.input_nodes == [x]


def test_the_emitter_s_setups_refuse_wrong_arguments():
    """``_emitter.setup`` and ``setup_regions`` check what they are handed (and keep what they
    held before: the region tests still build)."""
    with pytest.raises(TypeError, match="an exception class and a callable"):
        _emitter.setup(LimitError, None, MAX_REGS)
    with pytest.raises(TypeError):
        _emitter.setup(LimitError, print)
    limits = (MAX_INPUTS, MAX_OUTPUTS, MAX_INSTRS)
    given = [cl._RULES_BY_ID, Node, cl.Region, Emitter, None, None, (), limits]
    with pytest.raises(TypeError, match="region, domain and storable are callables"):
        _emitter.setup_regions(*given)
    given[3] = int
    with pytest.raises(TypeError, match="emitter must subclass Emitter"):
        _emitter.setup_regions(*given)
    with pytest.raises(TypeError):
        _emitter.setup_regions([], *given[1:])
    test_build_region_stores_a_value_once_per_dtype_reduction_and_alias_base()


def _grads(fn):
    """The gradient of ``fn(x).sum()`` by ``x``, as a function of ``x``."""

    def grad(x):
        x = x.detach().requires_grad_()
        return torch.autograd.grad(fn(x).sum(), x)[0]

    return grad


def _views(y):
    return y.clone() + 1, y.view(2, 4, 9).sin(), y.unsqueeze(0).expand(3, 8, 9) * 2, y.t().clone()


def _power(e):
    return lambda x: x**e


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
_FORM_CASES = [  # (function, its inputs' dtypes): nodes of every form, and ones a form leaves
    *[(f, (d,)) for d in (_F32, _BF16) for f in (torch.neg, torch.exp, torch.tanh, torch.rsqrt)],
    (lambda x, y: (x * y, x / 3, torch.maximum(x, y), torch.minimum(y, x), x / y), (_F32, _F32)),
    (lambda x, y: (x + y, x - 2, x.add(y, alpha=2), x.sub(y, alpha=0.5), 1 - x), (_F32, _F32)),
    *[(_power(e), (d,)) for e in (1, 2, 3, -1, 0.5, -0.5, 2.5, 3.0) for d in (_F32, _F16)],
    (lambda x, y: (x.abs() ** y, 2**x, torch.square(x), x.pow(True)), (_F32, _F32)),
    (lambda x: (x.sum(-1, keepdim=True), x.mean(-1, True), x.amax(-1, True)), (_F32,)),
    (lambda x: (x.sum(), x.mean(), x.sum([0, 1], keepdim=True), x.amin(-1, True)), (_F32,)),
    (lambda x: (x[:, :1].sum(-1, keepdim=True), x.sum(dim=-1, keepdim=True, dtype=_F32)), (_F32,)),
    (lambda x, y: (torch.where(x > 0, x, y), torch.where(x > y, 1.0, x), x.relu()), (_F32, _F32)),
    (lambda x: _views(x.exp()), (_F32,)),
    (lambda x: (torch.nn.functional.silu(x), x.softmax(-1), x.log_softmax(-1)), (_F32,)),
    (_grads(lambda x: x.softmax(-1) * x), (_F32,)),
    (_grads(lambda x: x.log_softmax(-1) * x), (_F32,)),
    (lambda x: (x.exp().to(_BF16), x.to(_F16).float(), (x.exp() > 1).float(), x.bool()), (_F32,)),
    (lambda x: (x.exp().float(), x.exp().half(), x.exp().bool(), x.sin().to(_F32)), (_BF16,)),
    (lambda x, m: (x.masked_fill(m, 0.5), x * m, m & (x > 0), ~m, m ^ (x < 0)), (_F32, torch.bool)),
]


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a graph that fell back fails
@pytest.mark.parametrize("case", range(len(_FORM_CASES)))
def test_native_forms_build_what_the_rules_build(case, native_checked):
    """Each region ``csrc/emitter.c`` builds with its forms equals the build by the Python
    rules alone (``native_checked``), over nodes of every form and its argument shapes."""
    fn, dtypes = _FORM_CASES[case]
    args = [
        _x(8, 9, seed=k).to(d) if d != torch.bool else _x(8, 9, seed=k) > 0
        for k, d in enumerate(dtypes)
    ]
    gm = make_fx(fn, tracing_mode="fake")(*args)
    compiled = compile_graph(gm, args, min_ops=1)
    assert compiled.regions


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_benchmark_chains_build_what_the_rules_build(native_checked):
    from dvm import benchmarks

    for chain in benchmarks.CHAINS:
        gm, inputs = benchmarks._aten_graph(chain)
        assert compile_graph(gm, inputs, min_ops=1).regions


def test_native_forms_lower_without_the_rules(monkeypatch):
    """A node of a form is lowered in C: its Python rule is not called (it is with
    ``setup_native({}, ...)``)."""
    _, a, (exp,) = _traced(lambda x: x.exp(), _x(4, 8))

    def emit(em, n, r):
        raise AssertionError("the rule was called")

    rule = cl._RULES_BY_ID[id(aten.exp.default)]
    monkeypatch.setitem(cl._RULES_BY_ID, id(aten.exp.default), dataclasses.replace(rule, emit=emit))
    assert build_region([exp], a).program.instrs[1].op == Op.EXP
    _emitter.setup_native({}, NATIVE_DTYPES)
    try:
        with pytest.raises(AssertionError, match="the rule was called"):
            build_region([exp], a)
    finally:
        _emitter.setup_native(NATIVE, NATIVE_DTYPES)
    assert build_region([exp], a).program.instrs[1].op == Op.EXP


def test_setup_native_refuses_wrong_arguments():
    """``_emitter.setup_native`` checks the forms and dtypes it is handed, and keeps the table
    it held before on an error."""
    with pytest.raises(TypeError):
        _emitter.setup_native([], NATIVE_DTYPES)
    with pytest.raises(TypeError):
        _emitter.setup_native(NATIVE, NATIVE_DTYPES[:3])
    with pytest.raises(TypeError, match="no \\(form, op\\) pair"):
        _emitter.setup_native({aten.exp.default: Form.UNARY}, NATIVE_DTYPES)
    with pytest.raises(ValueError, match=r"form 16 is not in 0\.\.15"):
        _emitter.setup_native({aten.exp.default: (16, 0)}, NATIVE_DTYPES)
    with pytest.raises(ValueError, match=r"op 40 is not in 10\.\.26"):
        _emitter.setup_native({aten.exp.default: (Form.UNARY, Op.ADD)}, NATIVE_DTYPES)
    with pytest.raises(ValueError, match=r"op 12 is not in 0\.\.0"):
        _emitter.setup_native({aten.exp.default: (Form.SILU, Op.EXP)}, NATIVE_DTYPES)
    with pytest.raises(TypeError):
        _emitter.setup_native({aten.exp.default: (Form.UNARY, "exp")}, NATIVE_DTYPES)
    with pytest.raises(ValueError, match="more than 128 forms"):
        _emitter.setup_native({k: (Form.IDENTITY, 0) for k in range(129)}, NATIVE_DTYPES)
    with pytest.MonkeyPatch.context() as monkeypatch:
        test_native_forms_lower_without_the_rules(monkeypatch)


def test_setup_native_reads_the_forms_as_handed():
    """An op's ``__index__`` that changes the forms while ``setup_native`` reads them (adding
    more entries than its table holds, or dropping the pair being read) neither overflows
    the table nor reads a freed pair: the forms are the entries handed."""
    forms = {}

    class Grows:
        def __index__(self):
            for _ in range(600):
                forms[object()] = (Form.IDENTITY, 0)
            return int(Form.IDENTITY)

    class Drops:
        def __index__(self):
            forms.clear()
            return 0

    try:
        forms[aten.exp.default] = (Grows(), 0)
        _emitter.setup_native(forms, NATIVE_DTYPES)
        forms.clear()
        forms[aten.exp.default] = (Form.IDENTITY, Drops())
        _emitter.setup_native(forms, NATIVE_DTYPES)
    finally:
        _emitter.setup_native(NATIVE, NATIVE_DTYPES)
    assert forms == {}


def _scaled_graph(value, dtype=torch.float32):
    """exp(x * value) built by hand (make_fx cannot trace an int past int64), fake values set."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.mul.Tensor, (x, value))
    z = g.call_function(aten.exp.default, (y,))
    g.output(z)
    with FakeTensorMode():
        fake = torch.empty(4, 3, dtype=dtype)
    for n in (x, y, z):
        n.meta["val"] = fake
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _verdicts(gm):
    """Each call node's reason from the analysis (``None``: analysed) and from
    ``unsupported_reason``, the Python account of the same checks."""
    nodes = list(gm.graph.nodes)
    a = _Analysis(nodes)
    reasons = dict(a.fallbacks)
    calls = [n for n in nodes if n.op == "call_function" and not has_side_effect(n)]
    return [(reasons.get(n), unsupported_reason(n)) for n in calls], a


def test_the_analysis_agrees_with_unsupported_reason_on_scalars_near_the_limits():
    top = int(torch.finfo(torch.float32).max)
    half_top = int(torch.finfo(torch.float16).max)
    cases = [
        (top, torch.float32, False),
        (top + 1, torch.float32, True),  # rounds to the limit as a double: compared exactly
        (10**400, torch.float32, True),
        (-(10**400), torch.float32, True),
        (1j, torch.float32, True),
        (float("inf"), torch.float32, False),
        (3.4e38, torch.float32, False),
        (1e38, torch.float32, False),
        (True, torch.float32, False),
        (half_top, torch.float16, False),
        (half_top + 1, torch.float16, True),
        (40000.0, torch.float16, False),
        (70000.0, torch.float16, True),
        (70000.0, torch.bfloat16, False),
    ]
    for value, dtype, refused in cases:
        verdicts, a = _verdicts(_scaled_graph(value, dtype))
        for got, want in verdicts:
            assert got == want, (value, dtype)
        mul = next(n for n in a.index if n.target == aten.mul.Tensor)
        assert (mul not in a.dshape) == refused, (value, dtype)


def test_the_analysis_agrees_with_unsupported_reason_on_many_graphs():
    x, w, i = _x(6, 10), _x(10, seed=1), torch.arange(6)
    graphs = [
        lambda x, w, i: (torch.sigmoid(x * w) + 1).softmax(-1).sum(0),
        lambda x, w, i: torch.where(x > 0, x, w).cumsum(-1) * 2,
        lambda x, w, i: (x.to(torch.bfloat16) * 3).float().mean(-1, keepdim=True) - x,
        lambda x, w, i: (x.t() * 2).exp() + i.view(1, 6).float(),
        lambda x, w, i: (x + i[:, None]).amax(0) * w,
        lambda x, w, i: x.expand(2, 6, 10).sum(-1) + (x > 1).logical_not().float().sum(-1),
    ]
    seen = []
    for fn in graphs:
        verdicts, _ = _verdicts(make_fx(fn, tracing_mode="fake")(x, w, i))
        assert [got for got, _ in verdicts] == [want for _, want in verdicts]
        seen += verdicts
    assert sum(got is None for got, _ in seen) >= 10
    assert sum(got is not None for got, _ in seen) >= 3


def test_the_merge_refuses_nodes_that_are_not_the_analysis_s():
    from dvm import _analysis

    gm = make_fx(lambda x: (x.exp() + 1).sin(), tracing_mode="fake")(_x(3, 4))
    nodes = list(gm.graph.nodes)
    a = _Analysis(nodes)
    assert [([str(n.target) for n in g], dead, work) for g, dead, work in a.groups()] == [
        (["aten.exp.default", "aten.add.Tensor", "aten.sin.default"], (), 3)
    ]
    work = cl._WORK_IDS
    with pytest.raises(ValueError, match="not the analysis's"):
        _analysis.merge(a, nodes[::-1], work)
    with pytest.raises(KeyError):
        _analysis.merge(a, [*nodes, object()], work)
    with pytest.raises(TypeError, match="nodes must be a list"):
        _analysis.merge(a, tuple(nodes), work)
    with pytest.raises(TypeError, match="work_ids must be a frozenset"):
        _analysis.merge(a, nodes, set(work))
    with pytest.raises(TypeError, match="work_ids must be a frozenset"):
        _analysis.merge(a, nodes)


def test_the_merge_counts_the_work_of_the_work_ids_it_is_given():
    """The ops of work_ids are kept for the frozenset last given: another one, even an equal
    one, is read afresh, and one holding something other than ids is refused."""
    from dvm import _analysis

    gm = make_fx(lambda x: (x.exp() + 1).sin(), tracing_mode="fake")(_x(3, 4))
    nodes = list(gm.graph.nodes)
    a = _Analysis(nodes)
    sin = {id(n.target) for n in nodes if str(n.target) == "aten.sin.default"}
    assert [work for _, _, work in _analysis.merge(a, nodes, cl._WORK_IDS)] == [3]
    assert [work for _, _, work in _analysis.merge(a, nodes, frozenset())] == [0]
    assert [work for _, _, work in _analysis.merge(a, nodes, frozenset(sin))] == [1]
    assert [work for _, _, work in _analysis.merge(a, nodes, frozenset(cl._WORK_IDS))] == [3]
    with pytest.raises(TypeError, match="must hold the ids of ops"):
        _analysis.merge(a, nodes, frozenset({"aten.sin.default"}))
    assert [work for _, _, work in _analysis.merge(a, nodes, cl._WORK_IDS)] == [3]


def test_the_merge_tells_each_group_s_live_and_dead_members_and_its_work():
    """Dead members (nothing outside reads them, nor a live member) are apart from the live
    ones, in graph order; the work counts the live members that stand for eager kernels (an
    expand does not)."""

    def fn(x, y):
        a = x.sin()
        (a * 3).exp()  # dead, merged with the live nodes
        return a + y.expand(4, 5)

    a = _Analysis(list(make_fx(fn, tracing_mode="fake")(_x(4, 5), _x(1, 5)).graph.nodes))
    ((live, dead, work),) = a.groups()
    assert [n.target for n in live] == [aten.sin.default, aten.expand.default, aten.add.Tensor]
    assert [n.target for n in dead] == [aten.mul.Tensor, aten.exp.default]
    assert work == 2


def test_a_long_chain_and_a_wide_fan_merge_within_the_limits():
    """2000 chained ops make regions of at most the VM's instruction count, in order; 300
    consumers of one value make groups each within the input and output limits."""

    def chain(x):
        for k in range(2000):
            x = x * 1.0001 if k % 2 else x + 0.5
        return x

    def fan(x, *ws):
        return [x * w for w in ws]

    gm = make_fx(chain, tracing_mode="fake")(_x(4, 8))
    groups = [live for live, _, _ in _Analysis(list(gm.graph.nodes)).groups()]
    assert sum(map(len, groups)) == 2000
    assert len(groups) > 1
    order = [n for g in groups for n in g]
    assert order == [n for n in gm.graph.nodes if n.op == "call_function"]
    ws = [_x(4, 8, seed=k) for k in range(300)]
    gm = make_fx(fan, tracing_mode="fake")(_x(4, 8), *ws)
    groups = [live for live, _, _ in _Analysis(list(gm.graph.nodes)).groups()]
    assert sum(map(len, groups)) == 300
    assert all(len(g) + 1 <= MAX_INPUTS and len(g) <= MAX_OUTPUTS for g in groups)
    assert len(groups) >= 300 // min(MAX_INPUTS - 1, MAX_OUTPUTS)


def test_storable_and_domain_of_the_c_analysis():
    from dvm import _analysis

    cases = [
        ((4, 8), (4, 8), False),
        ((8,), (4, 8), None),  # broadcast along a dim: not one of the domain's rows
        ((1, 8), (1, 8), False),
        ((4, 1), (4, 8), True),
        ((4,), (4, 8), None),
        ((1, 4, 1), (4, 8), None),  # more dims than the domain, not size 1 in front
        ((1,), (), True),
        ((), (), False),
        ((2, 3, 1), (2, 3, 5), True),
        ((3, 1), (2, 3, 5), None),
    ]
    for shape, domain, want in cases:
        assert _analysis.storable(shape, domain) is want, (shape, domain)
    with pytest.raises(ValueError, match="not a shape"):
        _analysis.storable([4], (4,))
    gm = make_fx(lambda x: x.exp(), tracing_mode="fake")(_x(3, 4))
    a = _Analysis(list(gm.graph.nodes))
    (exp,) = (n for n in gm.graph.nodes if n.op == "call_function")
    assert _analysis.domain(a, [exp]) == (3, 4)
    with pytest.raises(ValueError, match="no members"):
        _analysis.domain(a, [])
    with pytest.raises(KeyError):
        _analysis.domain(a, [next(iter(gm.graph.nodes))])  # a placeholder has no footprint


def test_the_analysis_s_facts_are_value_fact_s():
    """The C reads a plain tensor's fact itself (its size as the shape's product) and leaves
    the rest to ``value_fact``: the facts agree on every kind of value."""
    from dvm.lower import value_fact
    from dvm.program import MAX_DIMS

    values = [
        torch.empty(4, 3),
        torch.empty(4, 3, dtype=torch.bfloat16),
        torch.empty((), dtype=torch.float16),
        torch.empty(4, 3, device="meta"),
        torch.empty(4, 3, dtype=torch.int64),
        torch.empty(0, 3),
        torch.empty((1,) * (MAX_DIMS + 1)),
        torch.empty((1,) * MAX_DIMS),
        torch.empty(2**31, 2**31, dtype=torch.bool, device="meta"),
    ]
    for v in values:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        y = g.call_function(aten.exp.default, (x,))
        g.output(y)
        x.meta["val"] = y.meta["val"] = v
        a = _Analysis(list(g.nodes))
        want = value_fact(v)
        assert a.facts[y] == want, (v.shape, v.dtype, v.device)
        assert (y in a.dshape) == (type(want) is tuple)


def test_reasons_name_python_functions_by_module():
    """A function not known to be pure is named by module and name in its reason, an aten op
    without a lowering as torch prints it."""

    def scale(t):
        return t * 2

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(scale, (x,))
    z = g.call_function(torch.ops.aten.max.dim, (y, -1))
    g.output(z)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    t = torch.randn(4, 8)
    reasons = dict(compile_graph(gm, [t]).fallbacks)
    assert reasons[y].startswith(f"{__name__}.{scale.__qualname__} is not known to be pure")
    assert reasons[z] == "op aten.max.dim has no VM lowering"


def _checked_graphs():
    """Graphs of nodes whose rules have a check, or that make a bool, each way the check goes:
    reductions over other dims, without keepdim, over long rows, with a dtype argument; views,
    copies, division modes, bitwise ops and row ops that pass or not."""
    from dvm.program import MAX_ROW

    x, w, long = _x(6, 10), _x(10, seed=1), _x(2, MAX_ROW + 1)
    b = torch.tensor([[True], [False]]).expand(2, 10).clone()
    return [
        (lambda x, w: aten.sum.dim_IntList(x, [-1], True) + aten.sum.dim_IntList(x, [1]), (x, w)),
        (lambda x, w: aten.sum.dim_IntList(x, [0], True) * aten.mean.dim(x, [0, 1]), (x, w)),
        (lambda x, w: aten.sum.dim_IntList(x[None], [0]) + aten.sum.default(x), (x, w)),
        (lambda x, w: aten.mean.dim(x, None, True) + aten.amax.default(x, [-2, -1]), (x, w)),
        (lambda x, w: aten.amin.default(x, -1, True) * aten.amax.default(x[:1], 0), (x, w)),
        (lambda x, w: aten.sum.dim_IntList(x, [-1], dtype=torch.float32) + 1, (x, w)),
        (lambda x, w: aten.sum.dim_IntList(x.sum(), []) * aten.amax.default(w[None], []), (x, w)),
        (lambda x, w: aten.amax.default(x, [-1], True) - x.mean(-1, True), (long, w)),
        (lambda x, w: aten.sum.dim_IntList(x, [-1]) + 1, (long[:, :MAX_ROW], w)),
        (lambda x, w: x.view(6, 1, 10).exp() + x.view(60).sin().view(6, 10), (x, w)),
        (lambda x, w: x.unsqueeze(0).squeeze(0).cos() + x.reshape(10, 6).t(), (x, w)),
        (lambda x, w: x.to(torch.bfloat16).exp() + x.to("meta", torch.float16).cpu(), (x, w)),
        (lambda x, w: torch.div(x, w, rounding_mode="floor") + torch.div(x, w), (x, w)),
        (lambda x, w: (x > 0) & (w > 0) | ((x < 1) ^ (x > 2)), (x, w)),
        (lambda x, w: ((x > 0) * (w > 0)).logical_not() + (x.float() == 1), (x, w)),
        (lambda x, w: torch.bitwise_and(x, w) + 1, (b, b[0])),
        (lambda x, w: aten._softmax(x, -1, False) + aten._log_softmax(x, 0, False), (x, w)),
        (lambda x, w: aten._softmax(x[:, :1], 1, False) + aten._softmax(x.half(), 1, True), (x, w)),
        (lambda x, w: aten._softmax(x, -1, False) * 2, (long, w)),
        (
            lambda x, w: (
                aten._softmax_backward_data(x, x, -1, torch.float32)
                + aten._log_softmax_backward_data(x, x, 0, torch.float32)
            ),
            (x, w),
        ),
    ]


def test_the_analysis_agrees_with_the_python_on_checked_nodes():
    """The C analysis's verdicts match unsupported_reason's on nodes it works out itself and
    on those it refuses, and a reduction's domain shape is its input's shape with the dims
    dvm.lower.reduced_dims names set to 1."""
    from dvm.lower import REDUCE, RULES, reduced_dims

    seen = []
    for fn, inputs in _checked_graphs():
        gm = make_fx(fn, tracing_mode="fake")(*inputs)
        verdicts, a = _verdicts(gm)
        assert [got for got, _ in verdicts] == [want for _, want in verdicts], gm.graph
        seen += verdicts
        for n in a.dshape:
            if RULES[n.target].kind == REDUCE:
                dims = reduced_dims(n)
                shape = n.args[0].meta["val"].shape
                want = tuple(1 if d in dims else s for d, s in enumerate(shape))
                assert a.dshape[n] == want, n.format_node()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        floats = torch.empty(4, 3)
    g = torch.fx.Graph()  # bitwise ops on floats: no trace makes one
    x = g.placeholder("x")
    y = g.call_function(aten.bitwise_and.Tensor, (x, x))
    g.output(y)
    x.meta["val"] = y.meta["val"] = floats
    seen += _verdicts(torch.fx.GraphModule(torch.nn.Module(), g))[0]
    assert seen[-1][0] == seen[-1][1]
    reasons = {got for got, _ in seen if got is not None}
    for part in (
        "over dim 0",
        "dtype argument",
        "rows of 65537",
        "layout",
        "device meta",
        "rounding_mode",
        "non-bool",
        "half_to_float",
        "size 1",
        "bool result",
    ):
        assert any(part in why for why in reasons), part
    assert sum(got is None for got, _ in seen) >= 30


def test_the_analysis_agrees_with_the_python_on_other_devices():
    """A value on another device, or a fake tensor read inside a kernel invocation (where its
    device reads meta), is refused with dvm.lower's reason."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(aten.exp.default, (x,))
    g.output(y)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    mode = FakeTensorMode()
    with mode:
        cpu, meta = torch.empty(4, 3), torch.empty(4, 3, device="meta")
    for fake, inside in ((cpu, False), (meta, False), (cpu, True)):
        x.meta["val"] = y.meta["val"] = fake
        mode.in_kernel_invocation = inside
        try:
            verdicts = _verdicts(gm)[0]
        finally:
            mode.in_kernel_invocation = False
        assert verdicts[0][0] == verdicts[0][1]
        assert (verdicts[0][0] is None) == (fake is cpu and not inside), verdicts


def _analysed_in_c(nodes: list[Node]) -> tuple[_Analysis, list[str]]:
    """The analysis of ``nodes`` and the Python functions it called (besides its own
    ``__init__``)."""
    import sys

    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is not _Analysis.__init__.__code__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        return _Analysis(nodes), calls
    finally:
        sys.setprofile(None)


def test_the_analysis_asks_python_nothing_for_common_nodes():
    """RMSNorm, softmax, casts, views, comparisons and bool ops of CPU fake tensors: the
    analysis works each out in C, calling no Python function, and takes them all."""

    def fn(x, w):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        z = torch.where((y > 0) & (x < 1), y.softmax(-1), x.amax(-1, keepdim=True))
        return z.to(torch.bfloat16).view(6, 1, 10).float().sum(-1)

    gm = make_fx(fn, tracing_mode="fake")(_x(6, 10), _x(10, seed=1))
    nodes = list(gm.graph.nodes)
    a, calls = _analysed_in_c(nodes)
    assert calls == []
    assert a.fallbacks == []
    assert len(a.dshape) == sum(n.op == "call_function" for n in nodes) >= 15


def test_a_view_that_moves_values_is_refused_in_c_with_python_s_reason():
    """A view that changes more than size-1 dims (a transformer's head split, a flatten of a
    transpose) is refused by the C analysis with dvm.lower's reason, asking Python nothing;
    the same views of size-1 dims are taken."""
    from dvm.lower import VIEW_REFUSAL, unsupported_reason

    def fn(x):
        y = (x * 2).view(3, 2, 10).transpose(0, 1).reshape(6, 10)
        return y.view(2, 30) + 1, (x + 1).view(6, 1, 10)

    gm = make_fx(fn, tracing_mode="fake")(_x(6, 10))
    nodes = list(gm.graph.nodes)
    _Analysis(nodes)  # the transpose, an op without a rule, is asked of Python once an op
    a, calls = _analysed_in_c(nodes)
    assert calls == []
    refused = {n.name: why for n, why in a.fallbacks}
    moved = [n for n in nodes if n.target in (aten.view.default, aten._unsafe_view.default)]
    assert len(moved) == 4
    for n in moved:
        keeps = n.meta["val"].shape == (6, 1, 10)
        assert (n.name in refused) != keeps, n.name
        assert refused.get(n.name) == unsupported_reason(n)
        assert refused.get(n.name, VIEW_REFUSAL) == VIEW_REFUSAL


def _analysis_setup() -> tuple[list, tuple]:
    """cluster's ``_analysis.setup`` arguments, and the fast-path tuple after them."""
    from dvm import cluster as dc

    args = [
        dc._RULES_BY_ID,
        torch.Tensor,
        torch.device("cpu"),
        dc.DTYPE_CODES,
        dc.FLOAT_LIMITS,
        torch.bool,
        dc.MAX_DIMS,
        (dc.POINTWISE, dc.REDUCE, dc.ROW, dc.EXPAND, dc.CONST),
        (dc._eager, dc._EAGER, dc.rule_reason, dc.value_fact, dc.reduced_dims),
        (dc._ALIASING_OPS, aten.expand.default, MAX_INPUTS, MAX_OUTPUTS, dc.MAX_INSTRS),
    ]
    return args, dc._analysis_fast_path()


def test_the_analysis_setup_refuses_wrong_arguments():
    from dvm import _analysis

    args, (fake_tensor, bool_out, checks, max_row, refusal) = _analysis_setup()
    with pytest.raises(TypeError, match="7 checks, not 6"):
        _analysis.setup(*args, (fake_tensor, bool_out, checks[:6], max_row, refusal))
    with pytest.raises(TypeError):
        _analysis.setup(*args, (fake_tensor, set(bool_out), checks, max_row, refusal))
    with pytest.raises(TypeError):
        _analysis.setup(*args, ("FakeTensor", bool_out, checks, max_row, refusal))
    with pytest.raises(TypeError):
        _analysis.setup(*args, (fake_tensor, bool_out, checks, max_row, None))
    with pytest.raises(TypeError):
        _analysis.setup(*args)
    with pytest.raises(TypeError):
        _analysis.setup(*args, (fake_tensor, bool_out, checks, max_row, refusal), "Node")
    _analysis.setup(*args, (fake_tensor, bool_out, checks, max_row, refusal), Node)
    verdicts, _ = _verdicts(make_fx(lambda x: x.sum(-1) + 1, tracing_mode="fake")(_x(3, 4)))
    assert verdicts == [(None, None), (None, None)]


def test_the_c_node_list_is_the_graph_s():
    """``_analysis.nodes(graph)`` is ``list(graph.nodes)``: after a node is erased and one
    inserted too; an object without torch.fx's linked list is read through its ``nodes``."""
    from types import SimpleNamespace

    from dvm import _analysis

    gm = make_fx(lambda x: (x.exp() + 1).sin(), tracing_mode="fake")(_x(3, 4))
    graph = gm.graph
    assert _analysis.nodes(graph) == list(graph.nodes)
    x, exp, add, sin, out = graph.nodes
    with graph.inserting_after(x):
        cos = graph.call_function(aten.cos.default, (x,))
    add.replace_input_with(exp, cos)
    graph.erase_node(exp)
    assert _analysis.nodes(graph) == list(graph.nodes) == [x, cos, add, sin, out]
    assert _analysis.nodes(SimpleNamespace(nodes=(x, sin))) == [x, sin]
    with pytest.raises(AttributeError):
        _analysis.nodes(object())
    with pytest.raises(TypeError):
        _analysis.nodes(SimpleNamespace(nodes=3))


def test_the_analysis_reads_nodes_and_fake_tensors_directly_as_python_does():
    """With setup's Node, a Node's fields are read at their offsets and a FakeTensor's shape
    and dtype through their getters: the tables are those of the generic lookups (setup
    without Node, or nodes of a subclass of Node)."""
    from dvm import _analysis

    args, fast = _analysis_setup()

    def f(x, w):
        y = torch.softmax(x * w, -1).sum(-1, keepdim=True) / 3
        return y.view(-1).to(torch.float16), (x > 0) & (w < 1), x.mean(0)

    gm = make_fx(f, tracing_mode="fake")(_x(3, 4), _x(4))
    names = ("index", "segment", "fallbacks", "facts", "dshape", "cut", "footprint", "cost")

    def tables():
        a = _Analysis(list(gm.graph.nodes))
        return [getattr(a, k) for k in names], a.args, a.missing_meta

    direct = tables()
    assert len(direct[0][4]) >= 9
    assert all(type(v) is tuple for v in direct[1].values())
    try:
        _analysis.setup(*args, fast)
        assert tables() == direct
    finally:
        _analysis.setup(*args, fast, Node)

    class Sub(Node):
        pass

    for n in gm.graph.nodes:
        object.__setattr__(n, "__class__", Sub)
    assert tables() == direct


def test_cluster_fills_missing_fake_values_through_fill_meta():
    """``fill_meta`` is called once, with no arguments, when a placeholder has no fake value;
    the graph is then analysed again, and the fill's time is not in ``cluster_us``."""
    x = _x(3, 4)
    gm = make_fx(lambda t: t.exp() * 2, tracing_mode="fake")(x)
    placeholder = next(iter(gm.graph.nodes))
    val = placeholder.meta.pop("val")
    calls = []

    def fill(*args):
        calls.append(args)
        time.sleep(0.05)
        placeholder.meta["val"] = val

    clustering = cluster(gm, fill_meta=fill)
    assert calls == [()]
    assert len(clustering.regions) == 1
    assert clustering.cluster_us < 50_000
    assert cluster(gm, fill_meta=fill).regions  # its values there now: no call
    assert calls == [()]


def test_the_analysis_reads_each_rule_object_it_is_handed(monkeypatch):
    """The C analysis reads a rule's kind, check and cost once per rule object: a rule replaced
    under the same op is read anew (its cost here), and more rules than its table holds (it
    empties the table) are each read right."""
    gm = make_fx(lambda x: torch.exp(x) * 2, tracing_mode="fake")(_x(3, 4))
    exp = next(n for n in gm.graph.nodes if n.target == aten.exp.default)
    rule = cl._RULES_BY_ID[id(aten.exp.default)]
    for cost in (*range(1, 300), 7):
        monkeypatch.setitem(
            cl._RULES_BY_ID, id(aten.exp.default), dataclasses.replace(rule, cost=cost)
        )
        a = _Analysis(list(gm.graph.nodes))
        assert a.cost[exp] == cost
        assert a.dshape[exp] == (3, 4)


def test_the_analysis_compares_ops_by_their_text():
    """A node's op that is an equal str but not the interned one is the same op."""
    gm = make_fx(lambda x: torch.exp(x) * 2, tracing_mode="fake")(_x(3, 4))
    nodes = list(gm.graph.nodes)
    want = _Analysis(nodes)
    for n in nodes:
        n.op = "".join(list(n.op))  # a str of its own, equal to the interned one
        assert n.op is not sys.intern(n.op)
    got = _Analysis(nodes)
    assert (got.dshape, got.cost, got.facts) == (want.dshape, want.cost, want.facts)
