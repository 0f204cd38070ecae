"""dvm.executor: the scheduled graph runs like the GraphModule it came from."""

from __future__ import annotations

import operator
import types
import weakref

import pytest
import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.immutable_collections import immutable_dict, immutable_list

from dvm import _executor
from dvm.executor import Executor, RegionCall, Step, _Slot

aten = torch.ops.aten


def _module() -> GraphModule:
    """A graph with nested args (cat's list), kwargs, a method call, a parameter and a dict
    output holding an input and an intermediate."""
    root = torch.nn.Module()
    root.scale = torch.nn.Parameter(torch.tensor([2.0, 3.0, 4.0]))
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    w = g.get_attr("scale")
    e = g.call_function(aten.exp.default, (x,))
    c = g.call_function(aten.cat.default, ([e, y],), {"dim": 0})
    m = g.call_method("mul", (c, w))
    s = g.call_function(aten.sum.dim_IntList, (m, [0]), {"keepdim": True})
    g.output({"sum": s, "cat": c, "x": x})
    return GraphModule(root, g)


def test_runs_like_the_graph_module():
    gm = _module()
    x, y = torch.randn(2, 3), torch.randn(4, 3)
    run = Executor(gm, list(gm.graph.nodes))
    want, got = gm(x, y), run(x, y)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
    assert got["x"] is x
    flat = [s.flat for s in run.steps]
    assert flat == [True, False, True, True]  # cat's list of tensors takes the general path


def test_values_are_freed_after_their_last_use():
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.exp.default, (x,))
    b = g.call_function(aten.neg.default, (a,))
    seen = []

    def watch(t):
        seen.append(weakref.ref(t))
        return t.sum()

    c = g.call_function(watch, (b,))
    d = g.call_function(aten.add.Tensor, (c, 1))
    g.output((d,))
    gm = GraphModule(torch.nn.Module(), g)
    run = Executor(gm, list(gm.graph.nodes))
    (out,) = run(torch.randn(3))
    assert out.dim() == 0
    assert seen[0]() is None  # b's slot was cleared once watch had read it
    # x, a, b, c go at their last reader (x stays with the caller); d is returned
    assert [s.free for s in run.steps] == [(0,), (1,), (2,), (3,)]


def test_boxed_call_frees_each_input_after_its_last_use():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    seen = []

    def watch(t):
        seen.append(weakref.ref(t))
        return t

    a = g.call_function(aten.exp.default, (x,))
    w = g.call_function(watch, (y,))
    g.output((g.call_function(aten.add.Tensor, (a, w)), x))
    gm = GraphModule(torch.nn.Module(), g)
    run = Executor(gm, list(gm.graph.nodes))
    args = [torch.randn(3), torch.randn(3)]
    want = args[0].exp() + args[1]
    x_ref = weakref.ref(args[0])
    got = run.boxed(args)
    assert args == []  # the convention: the callee takes the list's references
    torch.testing.assert_close(got[0], want)
    assert x_ref() is got[1]  # an input returned as an output is kept
    assert seen[0]() is None  # y went once watch had read it, before the graph's end
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        run.boxed([torch.randn(3)])


def test_region_call_fills_each_output():
    g = Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.exp.default, (x,))
    b = g.call_function(aten.neg.default, (x,))
    c = g.call_function(aten.mul.Tensor, (a, b))
    g.output((c, a))
    gm = GraphModule(torch.nn.Module(), g)
    nodes = list(gm.graph.nodes)
    calls = []

    def region(t):
        calls.append(t)
        return t.exp(), -t

    order = [nodes[0], RegionCall(region, [x], [a, b]), nodes[3], nodes[4]]
    run = Executor(gm, order)
    t = torch.randn(5)
    got = run(t)
    torch.testing.assert_close(got[0], t.exp() * -t)
    torch.testing.assert_close(got[1], t.exp())
    assert len(calls) == 1
    assert run.targets == [region, aten.mul.Tensor]


def test_a_value_passed_by_keyword_is_read_from_its_slot():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    e = g.call_function(aten.exp.default, (x,))
    positive = g.call_function(aten.gt.Scalar, (x, 0))
    w = g.call_function(torch.where, (positive,), {"input": e, "other": y})
    g.output((w,))
    gm = GraphModule(torch.nn.Module(), g)
    run = Executor(gm, list(gm.graph.nodes))
    x, y = torch.randn(6), torch.randn(6)
    (got,) = run(x, y)
    torch.testing.assert_close(got, torch.where(x > 0, x.exp(), y))
    assert [s.flat for s in run.steps] == [True, True, False]  # where's values by keyword


def test_wrong_number_of_inputs_raises():
    gm = _module()
    run = Executor(gm, list(gm.graph.nodes))
    with pytest.raises(TypeError, match="takes 2 inputs, got 1"):
        run(torch.randn(2, 3))


def _pick(d, pair):
    return d["a"] + pair[0] * pair[1][0] * pair[1][1]


def _varied() -> tuple[GraphModule, list]:
    """A graph with nodes nested in a dict and a tuple holding a list, kwargs with and without
    nodes, a constant read twice, a method and a module call, an output of nested containers,
    and its order with a region call in place of two of its nodes."""
    root = torch.nn.Module()
    root.scale = torch.nn.Parameter(torch.tensor([2.0, 3.0]))
    root.lin = torch.nn.Linear(2, 2)
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    w = g.get_attr("scale")
    a = g.call_function(aten.exp.default, (y,))
    b = g.call_function(aten.add.Tensor, (x, y), {"alpha": 2})
    p = g.call_function(_pick, ({"a": a, "k": 3}, (b, [w, 1.5])))
    m = g.call_method("mul", (p, w))
    lin = g.call_module("lin", (m,))
    c = g.call_function(aten.cat.default, (), {"tensors": [lin, x], "dim": 0})
    r1 = g.call_function(aten.neg.default, (c,))
    r2 = g.call_function(aten.sin.default, (c,))
    s = g.call_function(aten.add.Tensor, (r1, r2))
    g.output({"s": s, "pair": (r2, [a]), "x": x})
    gm = GraphModule(root, g)
    nodes = list(gm.graph.nodes)

    def region(t):
        return -t, t.sin()

    return gm, [*nodes[:9], RegionCall(region, [nodes[8]], [nodes[9], nodes[10]]), *nodes[11:]]


def _exact(got, want):
    """``got == want`` with each container, slot reference and step of the same type."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            _exact(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want), (got, want)
        for k in want:
            _exact(got[k], want[k])
    else:
        assert got is want or got == want, (got, want)


def test_steps_of_a_varied_graph():
    gm, order = _varied()
    run = Executor(gm, order)
    s = _Slot
    region = order[9].runner
    method = run.steps[3].fn
    assert method.__closure__[0].cell_contents == "mul"
    e, seq = immutable_dict(), immutable_list  # the node's own empty kwargs; its lists' type
    cat = {"tensors": seq([s(7), s(0)]), "dim": 0}
    _exact(
        run.steps,
        [
            Step(aten.exp.default, (s(1),), e, True, 3, (), ()),
            Step(aten.add.Tensor, (s(0), s(1)), {"alpha": 2}, True, 4, (), (1,)),
            Step(_pick, ({"a": s(3), "k": 3}, (s(4), seq([s(2), 1.5]))), e, False, 5, (), (4,)),
            Step(method, (s(5), s(2)), e, True, 6, (), (5,)),
            Step(gm.lin, (s(6),), e, True, 7, (), (6,)),
            Step(aten.cat.default, (), cat, False, 8, (), (7,)),
            Step(region, (s(8),), {}, True, -1, (9, 10), (8,)),
            Step(aten.add.Tensor, (s(9), s(10)), e, True, 11, (), (9,)),
        ],
    )
    assert (run.n_inputs, run.n_slots) == (2, 12)
    assert run._constants == [(2, gm.scale)]
    assert run._constants[0][1] is gm.scale
    _exact(run._output, {"s": s(11), "pair": (s(10), seq([s(3)])), "x": s(0)})
    assert run.steps[5].kwargs is not order[8].kwargs  # a plain dict of its own
    assert run.steps[7].kwargs is order[10].kwargs  # no kwargs: the node's own
    x, y = torch.randn(2), torch.randn(2)
    want, got = gm(x, y), run(x, y)
    for k in ("s", "x"):
        torch.testing.assert_close(got[k], want[k])
    torch.testing.assert_close(got["pair"][0], want["pair"][0])
    torch.testing.assert_close(got["pair"][1][0], want["pair"][1][0])


def test_a_step_frees_its_last_reads_in_the_order_first_read():
    g = Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    a = g.call_function(aten.exp.default, (y,))
    g.output((g.call_function(aten.add.Tensor, (a, x)),))
    gm = GraphModule(torch.nn.Module(), g)
    run = Executor(gm, list(gm.graph.nodes))
    assert [s.free for s in run.steps] == [(1,), (2, 0)]  # a (slot 2) was read before x


def test_a_graph_without_calls():
    g = Graph()
    g.placeholder("x")
    g.output(None)
    gm = GraphModule(torch.nn.Module(), g)
    run = Executor(gm, list(gm.graph.nodes))
    assert (run.n_inputs, run.n_slots, run.steps) == (1, 1, [])
    assert run(torch.randn(2)) is None


def test_build_refuses_bad_arguments():
    gm, order = _varied()
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        _executor.build(gm)
    with pytest.raises(TypeError, match="units must be a sequence"):
        _executor.build(gm, 5)
    with pytest.raises(KeyError):  # a node read before any unit makes it
        Executor(gm, order[3:])
    with pytest.raises(AttributeError):
        Executor(gm, [object()])
    with pytest.raises(TypeError, match="RegionCall of 3 fields"):
        Executor(gm, [tuple.__new__(RegionCall, (1, 2))])
    for twice in (0, 3):  # a placeholder, a call: two units sharing a slot would mix values
        with pytest.raises(ValueError, match="is given twice"):
            Executor(gm, [*order[: twice + 1], order[twice], *order[twice + 1 :]])
    with pytest.raises(TypeError, match="not a NamedTuple"):
        _executor.setup(Node, dict, Step, RegionCall, Executor, len, len, ("args", "kwargs"))


def test_in_place_calls_each_region_at_its_last_node():
    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    region = types.SimpleNamespace(nodes=[nodes[10], nodes[9]], outputs=[nodes[9], nodes[10]])
    runner = types.SimpleNamespace(region=region, _inputs=[nodes[8]])
    got = _executor.in_place(nodes, [runner])
    _exact(got, [*nodes[:9], RegionCall(runner, [nodes[8]], [nodes[9], nodes[10]]), *nodes[11:]])
    assert got[9].inputs is runner._inputs
    early = types.SimpleNamespace(nodes=[nodes[3], nodes[10]], outputs=[nodes[10]])
    runner = types.SimpleNamespace(region=early, _inputs=[nodes[1], nodes[8]])
    assert _executor.in_place(nodes, [runner]) is None  # pick reads exp before the region


def test_schedule_is_the_executor_of_in_place():
    """``schedule`` makes, in one call, the Executor that ``Executor(gm, in_place(...))``
    makes: the same fields and steps, and it runs the same."""
    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    region = types.SimpleNamespace(nodes=[nodes[10], nodes[9]], outputs=[nodes[9], nodes[10]])
    runner = types.SimpleNamespace(region=region, _inputs=[nodes[8]])
    got = _executor.schedule(gm, nodes, [runner])
    want = Executor(gm, _executor.in_place(nodes, [runner]))
    assert type(got) is Executor
    fields = ("n_inputs", "n_slots", "_constants", "_output")
    assert set(Executor.__slots__) == {*fields, "steps"}  # the fields it sets
    assert [getattr(got, f) for f in fields] == [getattr(want, f) for f in fields]
    assert [type(s) for s in got.steps] == [Step] * len(want.steps)
    assert [s[1:] for s in got.steps] == [s[1:] for s in want.steps]
    assert [s.fn for s in got.steps if s.fn is not got.steps[3].fn] == [
        s.fn for s in want.steps if s.fn is not want.steps[3].fn
    ]  # all but the method call's, a function made for each Executor
    assert got.steps[6].fn is runner  # the region call, in place of nodes 9 and 10
    x, y = torch.randn(2, 2), torch.randn(2, 2)
    got, want = _executor.schedule(gm, nodes, [])(x, y), gm(x, y)
    assert got.keys() == want.keys()
    torch.testing.assert_close(got, want)
    early = types.SimpleNamespace(nodes=[nodes[3], nodes[10]], outputs=[nodes[10]])
    runner = types.SimpleNamespace(region=early, _inputs=[nodes[1], nodes[8]])
    assert _executor.schedule(gm, nodes, [runner]) is None  # in_place gives no order


def test_the_named_tuples_made_in_c_hash_as_tuples():
    """``_Slot``, ``Step`` and ``RegionCall`` are made in C as their type directly; each hashes
    as the tuple of its items (Python 3.14 caches a tuple's hash: a cache left at 0 would not)."""
    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    region = types.SimpleNamespace(nodes=[nodes[10], nodes[9]], outputs=(nodes[9], nodes[10]))
    runner = type("Runner", (), {"region": region, "_inputs": (nodes[8],)})()  # hashable
    run = _executor.schedule(gm, nodes, [runner])
    slot = run.steps[0].args[0]
    assert type(slot) is _Slot
    assert hash(slot) == hash(tuple(slot)) == hash(_Slot(slot.index))
    call = _executor.in_place(nodes, [runner])[9]
    assert type(call) is RegionCall
    assert hash(call) == hash(tuple(call)) == hash(RegionCall(*call))
    assert len({slot, _Slot(slot.index)}) == 1


def test_schedule_refuses_bad_arguments():
    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    with pytest.raises(TypeError, match="two lists after gm"):
        _executor.schedule(gm, nodes)
    with pytest.raises(TypeError, match="two lists after gm"):
        _executor.schedule(gm, tuple(nodes), [])
    empty = types.SimpleNamespace(region=types.SimpleNamespace(nodes=[], outputs=[]))
    with pytest.raises(ValueError, match="region 0 has no nodes"):
        _executor.schedule(gm, nodes, [empty])
    with pytest.raises(KeyError):  # a node read before any unit makes it
        _executor.schedule(gm, nodes[3:], [])


def test_in_place_refuses_bad_arguments():
    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    with pytest.raises(TypeError, match="takes two lists"):
        _executor.in_place(tuple(nodes), [])
    empty = types.SimpleNamespace(region=types.SimpleNamespace(nodes=[], outputs=[]))
    with pytest.raises(ValueError, match="region 0 has no nodes"):
        _executor.in_place(nodes, [empty])
    stranger = types.SimpleNamespace(region=types.SimpleNamespace(nodes=[nodes[3]], outputs=[]))
    with pytest.raises(KeyError):
        _executor.in_place(nodes[4:], [stranger])
    with pytest.raises(AttributeError):
        _executor.in_place(nodes, [object()])
    shared = types.SimpleNamespace(region=types.SimpleNamespace(nodes=[nodes[3]], outputs=[]))
    with pytest.raises(ValueError, match="region 0 shares a node with another"):
        _executor.in_place(nodes, [shared, shared])

    class Foreign:  # a node whose inputs are no dict
        _input_nodes = (nodes[2],)

    with pytest.raises(TypeError, match=r"inputs are .*, not a dict"):
        _executor.in_place([Foreign(), *nodes], [shared])


def test_in_place_takes_a_region_listing_a_node_twice_as_listing_it_once():
    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    region = types.SimpleNamespace(nodes=[nodes[9], nodes[10], nodes[9]], outputs=[nodes[9]])
    runner = types.SimpleNamespace(region=region, _inputs=[nodes[8]])
    got = _executor.in_place(nodes, [runner])
    _exact(got, [*nodes[:9], RegionCall(runner, [nodes[8]], [nodes[9]]), *nodes[11:]])


def test_a_node_inside_a_slice_is_read_at_each_call():
    """torch.fx keeps a node inside a slice (``x[:, : x.size(1) // 2]``): the step reads its
    value at each call. It was passed as the node itself, and every call raised TypeError."""
    from dvm.compile import compile_graph

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.size(1) // 2].exp() * 2

    gm = torch.fx.symbolic_trace(fn)
    x = torch.randn(3, 8)
    compiled = compile_graph(gm, [x])
    (getitem,) = [s for s in compiled.run.steps if s.fn is operator.getitem]
    assert not getitem.flat
    assert type(getitem.args[1][1].stop) is _Slot
    torch.testing.assert_close(compiled(x), fn(x))
    y = torch.randn(3, 8)
    torch.testing.assert_close(compiled(y), fn(y))


def test_setup_reads_no_member_of_another_type():
    """A field whose descriptor is another type's member (set into the class's dict) is read
    by name, as Python reads it (a TypeError), not at that type's offset."""
    import dvm.executor as ex
    from dvm import _executor

    class Big:
        __slots__ = tuple("abcdefghijklmnopqrstuvwxyz")

    class Foreign:
        op = Big.__dict__["z"]

    fields = ("_args", "_kwargs") if hasattr(ex.Node, "_args") else ("args", "kwargs")
    try:
        _executor.setup(
            Foreign, ex._Slot, ex.Step, ex.RegionCall, ex.Executor, ex._method, ex._attr, fields
        )
        with pytest.raises(TypeError, match="doesn't apply"):
            _executor.build(None, (Foreign(),))
    finally:
        _executor.setup(
            ex.Node, ex._Slot, ex.Step, ex.RegionCall, ex.Executor, ex._method, ex._attr, fields
        )


def test_schedule_refuses_an_executor_whose_new_makes_another_type():
    """schedule() writes an Executor's fields at its slots' offsets: into an object of another
    type (an ``__new__`` of its own) they would overwrite that object's memory."""
    import dvm.executor as ex
    from dvm import _executor

    class Odd(ex.Executor):
        __slots__ = ()

        def __new__(cls, *args):
            return 10**30

    gm, _ = _varied()
    nodes = list(gm.graph.nodes)
    fields = ("_args", "_kwargs") if hasattr(ex.Node, "_args") else ("args", "kwargs")
    try:
        _executor.setup(
            ex.Node, ex._Slot, ex.Step, ex.RegionCall, Odd, ex._method, ex._attr, fields
        )
        with pytest.raises(TypeError, match=r"Odd.__new__ made a int"):
            _executor.schedule(gm, nodes, [])
    finally:
        _executor.setup(
            ex.Node, ex._Slot, ex.Step, ex.RegionCall, ex.Executor, ex._method, ex._attr, fields
        )
    assert type(_executor.schedule(gm, nodes, [])) is ex.Executor
