"""has_side_effect: each way a graph may mutate a value, against pure calls of each kind."""

from __future__ import annotations

import gc
import math
import operator
import weakref

import pytest
import torch
from torch.fx import Graph, GraphModule, Node

from spore.side_effects import has_side_effect

aten = torch.ops.aten


class _AddsOne(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t.add_(1.0)


def _bump(t: torch.Tensor) -> None:  # a user's function
    t.mul_(2.0)


def _node(make) -> Node:
    """The node ``make(graph, x)`` adds to a graph over one placeholder ``x``."""
    g = Graph()
    x = g.placeholder("x")
    node = make(g, x)
    g.output(x)
    root = torch.nn.Module()
    root.adds_one = _AddsOne()
    GraphModule(root, g)
    return node


EFFECTS = {
    "a mutating op": lambda g, x: g.call_function(aten.add_.Tensor, (x, 1.0)),
    "an out= op": lambda g, x: g.call_function(aten.add.out, (x, x), {"out": x}),
    "a method": lambda g, x: g.call_method("add_", (x, 1.0)),
    "a module": lambda g, x: g.call_module("adds_one", (x,)),
    "operator.iadd": lambda g, x: g.call_function(operator.iadd, (x, 1.0)),
    "operator.setitem": lambda g, x: g.call_function(operator.setitem, (x, 0, 1.0)),
    "torch.Tensor.add_": lambda g, x: g.call_function(torch.Tensor.add_, (x, 1.0)),
    "torch.Tensor.__iadd__": lambda g, x: g.call_function(torch.Tensor.__iadd__, (x, 1.0)),
    "an op packet": lambda g, x: g.call_function(aten.add_, (x, 1.0)),
    "a pure op's packet": lambda g, x: g.call_function(aten.add, (x, 1.0), {"out": x}),
    "inplace=True": lambda g, x: g.call_function(torch.nn.functional.relu, (x,), {"inplace": True}),
    "a user's function": lambda g, x: g.call_function(_bump, (x,)),
}
PURE = {
    "an op": lambda g, x: g.call_function(aten.mul.Tensor, (x, x)),
    "operator.getitem": lambda g, x: g.call_function(operator.getitem, (x, 0)),
    "operator.mul": lambda g, x: g.call_function(operator.mul, (x, 2)),
    "math.sqrt": lambda g, x: g.call_function(math.sqrt, (4.0,)),
    "torch.sym_max": lambda g, x: g.call_function(torch.sym_max, (2, 3)),
    "a placeholder": lambda g, x: x,
}


@pytest.mark.parametrize("how", EFFECTS)
def test_a_call_that_may_mutate_has_a_side_effect(how):
    node = _node(EFFECTS[how])
    assert has_side_effect(node)
    assert has_side_effect(node)  # remembered alike


@pytest.mark.parametrize("how", PURE)
def test_a_call_known_to_be_pure_has_none(how):
    assert not has_side_effect(_node(PURE[how]))


def test_torch_s_check_misses_what_has_side_effect_finds():
    """The reason for the module: torch calls these pure."""
    missed = [h for h, make in EFFECTS.items() if not _node(make).is_impure()]
    assert {"a method", "operator.iadd", "an op packet", "inplace=True"} <= set(missed)


def test_a_random_op_counts_unless_random_is_false():
    node = _node(lambda g, x: g.call_function(aten.rand_like.default, (x,)))
    assert has_side_effect(node)
    assert not has_side_effect(node, random=False)
    assert has_side_effect(node)


def test_an_auto_functionalized_op_has_the_side_effect_of_the_op_it_wraps():
    """The wrapped op (its first argument) decides: remembering the wrapper alone gave every
    later auto_functionalized node the first one's answer (a gradient accumulation seen as
    pure after a pure mutating op, or the other way)."""
    wrapper = torch.ops.higher_order.auto_functionalized
    g = Graph()
    x = g.placeholder("x")
    pure = g.call_function(wrapper, (aten.add_.Tensor,), {"self": x, "other": x})
    effect = g.call_function(wrapper, (torch.ops.inductor.accumulate_grad_.default,), {})
    assert [has_side_effect(pure), has_side_effect(effect)] == [False, True]
    assert [pure.is_impure(), effect.is_impure()] == [False, True]


def test_a_cached_verdict_holds_its_op_so_no_other_op_takes_its_id() -> None:
    """Verdicts were cached by id(op) alone: once a library was destroyed, a new (mutating)
    op could get the freed op's id and its verdict, "no side effect"."""
    lib = torch.library.Library("spore_side_effects_test", "FRAGMENT")
    lib.define("pure_once(Tensor x) -> Tensor")
    op = torch.ops.spore_side_effects_test.pure_once.default
    graph = Graph()
    assert has_side_effect(graph.call_function(op, (graph.placeholder("x"),))) is False
    alive = weakref.ref(op)
    del op, graph
    lib._destroy()
    del lib
    gc.collect()
    assert alive() is not None
