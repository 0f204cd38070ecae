"""dvm.executor: the scheduled graph runs like the GraphModule it came from."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.fx import Graph, GraphModule

from dvm.executor import Executor, RegionCall

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
