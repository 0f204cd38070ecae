"""compile_graph: regions run on the VM; guards and VM errors fall back to eager with a
recorded reason; graphs without fake values, side effects and compile times."""

from __future__ import annotations

import math
import operator
import types
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dvm.compile as dc
from dvm import _executor
from dvm.compile import compile_graph

aten = torch.ops.aten


def _fn(x, w):
    return torch.sigmoid(x * w).exp() + x.amax(-1, keepdim=True)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 10, generator=g), torch.randn(10, generator=g)


def test_regions_run_on_the_vm_not_the_reference():
    assert dc.EXECUTOR == "vm"
    from dvm import _launcher, vm

    assert dc.PREPARE is vm.Kernel
    x, w = _inputs()
    c = compile_graph(make_fx(_fn, tracing_mode="fake")(x, w), [x, w])
    assert isinstance(c.runners[0]._guarded.__self__, _launcher.Launcher)
    torch.testing.assert_close(c(x, w)[0] if isinstance(c(x, w), tuple) else c(x, w), _fn(x, w))
    assert c.vm_calls == 2
    # the graph calls the region runner, not the original aten ops
    targets = c.run.targets
    assert c.runners[0] in targets
    assert aten.exp.default not in targets


@pytest.mark.parametrize("executor", ["vm", "reference"])
def test_outputs_keep_the_traced_layout(monkeypatch, executor):
    if executor == "reference":
        monkeypatch.setattr(dc, "PREPARE", dc._Reference)

    def rope_like(q, cos):  # q is a transposed view, as after HF's .view(...).transpose(1, 2)
        return (q * cos + q.neg()).sigmoid()

    q = torch.randn(2, 6, 3, 8).transpose(1, 2)
    cos = torch.randn(6, 8)
    c = compile_graph(make_fx(rope_like, tracing_mode="fake")(q, cos), [q, cos])
    got = c(q, cos)
    got = got[0] if isinstance(got, tuple) else got
    want = rope_like(q, cos)
    assert c.vm_calls == 1
    assert got.stride() == want.stride() != want.contiguous().stride()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("executor", ["vm", "reference"])
def test_an_expanded_output_stays_a_view(monkeypatch, executor):
    """F.normalize's divisor, expanded over the row (a stride 0), is also an output (saved
    for backward, as in Swin v2): the expand stays eager's view of the small divisor (stored by
    the region, it was written out in full), and the region reads it through its stride 0;
    equal to eager, the graph compiled."""
    if executor == "reference":
        monkeypatch.setattr(dc, "PREPARE", dc._Reference)

    def normalize(x, norm):
        d = norm.clamp_min(1e-12).expand_as(x)
        return (x / d).exp(), d

    x = torch.randn(4, 3, 8).transpose(0, 1)
    norm = torch.rand(3, 4, 1) + 0.5
    gm = make_fx(normalize, tracing_mode="fake")(x, norm)
    (expand,) = [n for n in gm.graph.nodes if n.target == aten.expand.default]
    assert 0 in expand.meta["val"].stride()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = compile_graph(gm, [x, norm])
    got = c(x, norm)
    want = normalize(x, norm)
    (region,) = c.regions
    assert c.vm_calls == 1
    assert expand not in region.nodes
    assert got[1].stride() == want[1].stride() == (4, 1, 0)
    assert got[0].stride() == want[0].stride()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("executor", ["vm", "reference"])
def test_a_region_of_0d_values_runs_over_one_element(monkeypatch, executor):
    """A scale worked out from a 0-d tensor (DeBERTa's ``sqrt(tensor(d) * factor)``): the
    region's domain is ``(1,)``, its output 0-d as eager's."""
    if executor == "reference":
        monkeypatch.setattr(dc, "PREPARE", dc._Reference)

    def scale(d, x):
        s = torch.sqrt(d * 2.0)
        return x / s, s

    d, x = torch.tensor(16.0), torch.randn(3, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = compile_graph(make_fx(scale, tracing_mode="fake")(d, x), [d, x], min_ops=1)
    got = c(d, x)
    want = scale(d, x)
    assert [r.domain for r in c.regions] == [(1,), (3, 5)]
    assert c.vm_calls == 2
    assert got[1].shape == torch.Size([])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_graph_without_fake_values_gets_them():
    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    for n in gm.graph.nodes:
        n.meta.pop("val", None)
    c = compile_graph(gm, [x, w])
    assert len(c.regions) == 1
    torch.testing.assert_close(c(x, w), _fn(x, w))
    assert c.vm_calls == 1


def test_fake_values_are_made_only_where_a_node_needs_one(monkeypatch):
    """The analysis says a graph needs fake values when a placeholder or a read call has no
    ``meta["val"]``; an output, a call nothing reads (an ``_assert_scalar``) or a node with its
    value needs none, and compile_graph then propagates none."""
    from dvm.cluster import _Analysis

    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    nodes = list(gm.graph.nodes)
    assert _Analysis(nodes).missing_meta is False
    assert _Analysis([]).missing_meta is False
    out = nodes[-1]
    out.meta.pop("val", None)
    with gm.graph.inserting_before(out):
        unread = gm.graph.call_function(aten.exp.default, (nodes[0],))
    assert _Analysis(list(gm.graph.nodes)).missing_meta is False
    calls = []
    monkeypatch.setattr(dc, "_ensure_meta", lambda *a: calls.append(a))
    c = compile_graph(gm, [x, w])
    assert calls == []
    assert "val" not in unread.meta
    torch.testing.assert_close(c(x, w), _fn(x, w))
    for n in (nodes[0], nodes[2]):  # a placeholder, a call read by others
        val = n.meta.pop("val")
        assert _Analysis(nodes).missing_meta is True
        n.meta["val"] = val


def test_a_failed_fake_propagation_is_raised_not_run_eagerly(monkeypatch):
    """Fake values that cannot be made are the caller's error, as before clustering."""
    from torch.fx.passes import fake_tensor_prop

    root = ValueError("the root cause")

    def fail(*args):
        raise RuntimeError("no fake values here") from root

    monkeypatch.setattr(fake_tensor_prop.FakeTensorProp, "propagate_dont_convert_inputs", fail)
    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    next(iter(gm.graph.nodes)).meta.pop("val")
    with pytest.raises(RuntimeError, match="no fake values here") as caught:
        compile_graph(gm, [x, w])
    assert caught.value.__cause__ is root  # the propagation's own chain is kept


@pytest.mark.parametrize("bad", [[object()], [types.SimpleNamespace(op="placeholder")]])
def test_the_analysis_rejects_what_is_not_nodes(bad):
    from dvm.cluster import _Analysis

    with pytest.raises((TypeError, AttributeError)):
        _Analysis(bad)


def _one_region():
    x, w = _inputs()
    c = compile_graph(make_fx(_fn, tracing_mode="fake")(x, w), [x, w])
    (runner,) = c.runners
    return c, runner, x, w


def test_guard_shape_dtype_and_grad_fall_back_with_reasons():
    _, runner, x, w = _one_region()
    want = (runner.eager(x, w),)
    cases = [
        ((torch.randn(3, 10), w), "shape"),
        ((x.double(), w.double()), "dtype"),
        ((x.requires_grad_(), w), "requires grad"),
        ((torch.randn(x.shape, dtype=torch.complex64).conj().imag, w), "negated view"),
    ]
    for args, what in cases:
        out = runner(*args)
        assert what in next(reversed(runner.fallback_reasons)), runner.fallback_reasons
        ref = runner.eager(*args)
        torch.testing.assert_close(out[0], ref[0])
    assert runner.eager_calls == 4
    assert runner.vm_calls == 0
    x.requires_grad_(False)
    torch.testing.assert_close(runner(x, w)[0], want[0][0])
    assert runner.vm_calls == 1


def test_a_runner_starts_with_no_calls_and_counts_its_own():
    _, runner, x, w = _one_region()
    other = dc.RegionRunner(runner.region, 7)
    assert (runner.__name__, runner.__qualname__) == ("dvm_region_0", "dvm_region_0")
    assert (other.__name__, other.__qualname__) == ("dvm_region_7", "dvm_region_7")
    assert (dc.RegionRunner.__name__, dc.RegionRunner.__qualname__) == ("RegionRunner",) * 2
    assert (runner.vm_calls, runner.eager_calls, runner.fallback_reasons) == (0, 0, {})
    runner(x, w)
    runner(x.double(), w.double())
    assert (runner.vm_calls, runner.eager_calls, len(runner.fallback_reasons)) == (1, 1, 1)
    assert (other.vm_calls, other.eager_calls, other.fallback_reasons) == (0, 0, {})


def test_vm_error_falls_back_to_eager(monkeypatch):
    c, runner, x, w = _one_region()

    def broken(args, results):
        raise RuntimeError("simulated VM failure")

    monkeypatch.setattr(runner, "_guarded", broken)
    torch.testing.assert_close(c(x, w), _fn(x, w))
    assert runner.eager_calls == 1
    (reason,) = runner.fallback_reasons
    assert "simulated VM failure" in reason


def test_max_row_is_the_vms():
    from dvm import _lib
    from dvm.program import MAX_ROW

    lib, _ = _lib.library()
    assert lib.dvm_max_row() == MAX_ROW


@pytest.mark.parametrize(
    "reduce",
    [
        lambda t: torch.softmax(t, -1),
        lambda t: torch.log_softmax(t, -1),
        lambda t: t.sum(-1),
        lambda t: t.amax(-1, keepdim=True),
        lambda t: t.amin(-1),
        lambda t: torch.var_mean(t, -1),
    ],
    ids=["softmax", "log_softmax", "sum", "amax", "amin", "var_mean"],
)
def test_long_rows_beyond_the_vm_stay_eager_at_compile(reduce):
    """A reduction over rows longer than the VM takes is a fallback naming the rows, known at
    compile time (``dvm.explain`` lists it); the ops before it keep their region, which runs
    on the VM (it used to join a region whose every call the VM refused)."""
    from dvm.program import MAX_ROW

    # values in [0, 1): exp(2x) stays small, so log_softmax's output is far from 0 and the
    # VM's exp, a few ulps off eager's, cannot push a relative difference past the tolerance
    x = torch.rand(2, MAX_ROW + 1, generator=torch.Generator().manual_seed(0))
    fn = lambda t: reduce((t * 2).exp())  # noqa: E731
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=_decomps())(x)
    c = compile_graph(gm, [x])
    torch.testing.assert_close(c(x), fn(x))
    assert c.eager_calls == 0
    assert c.vm_calls == len(c.regions)
    assert c.regions[0].ops == ["aten.mul.Tensor", "aten.exp.default"]
    assert any(f"rows of {MAX_ROW + 1} elements" in why for _, why in c.fallbacks)


def test_rows_the_vm_takes_are_reduced_on_it():
    from dvm.program import MAX_ROW

    x = torch.randn(2, MAX_ROW)
    fn = lambda t: torch.softmax(t * 2, -1)  # noqa: E731
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=_decomps())(x)
    c = compile_graph(gm, [x])
    torch.testing.assert_close(c(x), fn(x))
    assert c.vm_calls == 1
    assert c.eager_calls == 0
    assert not c.fallbacks


def _decomps():
    from dvm.lower import decomposition_table

    return decomposition_table()


def test_side_effects_keep_their_place():
    x = torch.randn(4, 5)
    g = torch.fx.Graph()
    a = g.placeholder("a")
    buf = g.placeholder("buf")
    y = g.call_function(aten.exp.default, (a,))
    g.call_function(aten.copy_.default, (buf, y))  # buf <- exp(a)
    z = g.call_function(aten.mul.Tensor, (buf, 2.0))  # reads buf after the copy
    w = g.call_function(aten.add.Tensor, (z, y))
    g.output((w,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    buf_e, buf_c = torch.zeros(4, 5), torch.zeros(4, 5)
    want = gm(x, buf_e)[0]
    c = compile_graph(gm, [x, buf_c], min_ops=1)  # the exp alone is a region here
    got = c(x, buf_c)[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf_c, buf_e)
    assert len(c.regions) == 2  # exp before the copy, mul+add after it
    order = c.run.targets
    copy = order.index(aten.copy_.default)
    runners = [i for i, fn in enumerate(order) if isinstance(fn, dc.RegionRunner)]
    assert runners[0] < copy < runners[1]
    assert operator.add not in order


class _AddsOne(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t.add_(1.0)


def _bump(t: torch.Tensor) -> None:  # a user's function, opaque to the compile
    t.mul_(2.0)


def _batch_norm(g, buf):  # training: updates its running mean, buf's first row
    mean = g.call_function(aten.select.int, (buf, 0, 0))
    var = g.call_function(aten.ones_like.default, (mean,))
    return g.call_function(torch.nn.functional.batch_norm, (buf, mean, var), {"training": True})


_MUTATIONS = {  # one way of each kind a hand-built graph mutates buf (core's tests have all)
    "call_method add_": lambda g, buf: g.call_method("add_", (buf, 1.0)),
    "operator.iadd": lambda g, buf: g.call_function(operator.iadd, (buf, 1.0)),
    "call_module": lambda g, buf: g.call_module("adds_one", (buf,)),
    "an op packet": lambda g, buf: g.call_function(aten.add_, (buf, 1.0)),
    "inplace=True": lambda g, buf: g.call_function(
        torch.nn.functional.relu, (buf,), {"inplace": True}
    ),
    "batch_norm's running mean": _batch_norm,
    "a user's function": lambda g, buf: g.call_function(_bump, (buf,)),
}


def _mutating_graph(mutate) -> torch.fx.GraphModule:
    """sigmoid(x * buf), then ``mutate(buf)``, then exp(that + buf): each op reads buf as it is
    at its place in the graph."""
    g = torch.fx.Graph()
    x, buf = g.placeholder("x"), g.placeholder("buf")
    before = g.call_function(aten.sigmoid.default, (g.call_function(aten.mul.Tensor, (x, buf)),))
    side = mutate(g, buf)
    after = g.call_function(aten.exp.default, (g.call_function(aten.add.Tensor, (before, buf)),))
    g.output((after, side))
    root = torch.nn.Module()
    root.adds_one = _AddsOne()
    return torch.fx.GraphModule(root, g)


@pytest.mark.parametrize("how", _MUTATIONS)
def test_a_call_that_may_mutate_is_a_barrier(how):
    """A graph handed to ``compile_graph`` that mutates a value between two ops reading it, by
    a method, a module, an op packet or a plain Python callable (which torch's purity check
    calls pure): no region spans the call, and each op reads the value as
    eager's does (a region spanning it would read the mutated value for both)."""
    gm = _mutating_graph(_MUTATIONS[how])
    x, buf = torch.randn(4, 6), torch.randn(4, 6)
    buf_e, buf_c = buf.clone(), buf.clone()
    want = gm(x, buf_e)[0]
    c = compile_graph(gm, [x, buf.clone()])
    got = c(x, buf_c)[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(buf_c, buf_e)
    assert [r.ops for r in c.regions] == [
        ["aten.mul.Tensor", "aten.sigmoid.default"],
        ["aten.add.Tensor", "aten.exp.default"],
    ]
    assert c.vm_calls == 2
    (node,) = [n for n, why in c.fallbacks if "no region spans it" in why]
    assert node is _side_effect_node(gm), c.fallbacks


def _side_effect_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The mutating call of :func:`_mutating_graph`'s graph: the second output."""
    return gm.graph.output_node().args[0][1]


@pytest.mark.parametrize("pure", [operator.neg, operator.getitem, math.fabs])
def test_a_call_known_to_be_pure_is_no_barrier(pure):
    """A call of a plain callable known to mutate nothing (Python's operators, ``math``'s
    functions): the ops around it still make one region."""
    args = {operator.getitem: lambda buf: (buf, 0), math.fabs: lambda buf: (2.0,)}
    gm = _mutating_graph(lambda g, buf: g.call_function(pure, args.get(pure, lambda b: (b,))(buf)))
    x, buf = torch.randn(4, 6), torch.randn(4, 6)
    c = compile_graph(gm, [x, buf])
    for got, want in zip(c(x, buf), gm(x, buf), strict=True):
        torch.testing.assert_close(got, want)
    assert [len(r.nodes) for r in c.regions] == [4]


def test_compile_times_are_recorded():
    c, runner, _, _ = _one_region()
    assert runner.region.build_us > 0
    assert runner.compile_us >= runner.region.build_us
    assert c.total_us >= c.clustering.cluster_us > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_outputs_and_inputs(dtype):
    x, w = (t.to(dtype) for t in _inputs())
    fn = lambda a, b: (a.float() * b.float()).sigmoid().to(dtype)  # noqa: E731
    c = compile_graph(make_fx(fn, tracing_mode="fake")(x, w), [x, w])
    got = c(x, w)
    assert got.dtype == dtype
    torch.testing.assert_close(got, fn(x, w), atol=0, rtol=0)
    assert c.vm_calls == 1


def test_a_region_read_between_its_nodes_moves_before_the_reader():
    def fn(x):
        a = x.exp()
        b = a.cumsum(-1)  # eager, placed between the region's nodes, reads one of them
        return b, x.sin() * 2 + a

    x = torch.randn(3, 5)
    gm = make_fx(fn, tracing_mode="fake")(x)
    c = compile_graph(gm, [x])
    (runner,) = c.runners
    assert {str(t) for t in runner.region.ops} >= {"aten.exp.default", "aten.sin.default"}
    # called just before the reader, the graph's order otherwise kept (no reordering)
    assert _executor.in_place(list(gm.graph.nodes), c.runners) is None  # not at its last node
    assert _executor.schedule(gm, list(gm.graph.nodes), c.runners) is None
    assert dc._before_readers(list(gm.graph.nodes), c.runners) is not None
    assert c.run.targets == [runner, aten.cumsum.default]
    for got, want in zip(c(x), fn(x), strict=True):
        torch.testing.assert_close(got, want)


def test_a_region_reading_a_value_made_after_its_first_reader_is_reordered():
    """The region (exp, sin, mul, add) is read by the first cumsum, before the second cumsum
    makes a value it reads: it cannot be called before its reader, nor where its last node
    was; the graph is reordered (the second cumsum moves up), the results as eager's."""

    def fn(x):
        a = x.exp()
        b = a.cumsum(-1)  # reads a region value
        y = x.cumsum(0)  # made after b, read by the region
        return b, x.sin() * y + a

    x = torch.randn(3, 5)
    gm = make_fx(fn, tracing_mode="fake")(x)
    c = compile_graph(gm, [x])
    (runner,) = c.runners
    assert len(runner.region.nodes) == 4
    assert dc._before_readers(list(gm.graph.nodes), c.runners) is None
    order = c.run.targets
    assert order.index(aten.cumsum.default) < order.index(runner)  # y's cumsum first
    assert order.count(aten.cumsum.default) == 2
    for got, want in zip(c(x), fn(x), strict=True):
        torch.testing.assert_close(got, want)


def test_regions_reading_each_other_are_called_in_their_order():
    """Two regions split by a cumsum, the second reading the first, both read early by eager
    nodes: each called before its first reader, the first region first."""

    def fn(x):
        a = x.exp() * 2  # region 1
        s = a.cumsum(-1)  # reads region 1
        d = (s.sin() + a).neg()  # region 2: reads region 1 and s
        t = d.cumsum(-1)  # reads region 2
        return t, d * 3

    x = torch.randn(4, 6)
    gm = make_fx(fn, tracing_mode="fake")(x)
    c = compile_graph(gm, [x])
    assert len(c.runners) == 2
    assert dc._before_readers(list(gm.graph.nodes), c.runners) is not None
    first, second = c.runners
    assert c.run.targets.index(first) < c.run.targets.index(second)
    for got, want in zip(c(x), fn(x), strict=True):
        torch.testing.assert_close(got, want)


def test_regions_are_called_where_their_last_node_was():
    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    c = compile_graph(gm, [x, w])
    (runner,) = c.runners
    members = set(runner.region.nodes)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    last = max(calls.index(n) for n in members)
    before = [n.target for n in calls[:last] if n not in members]
    after = [n.target for n in calls[last:] if n not in members]
    assert c.run.targets == [*before, runner, *after]


def _compiled(fn, *args, min_ops=1):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return compile_graph(gm, list(args), min_ops=min_ops)


def test_equal_values_of_two_nodes_are_two_tensors():
    """The same expression written twice, the second viewed: eager returns two tensors, so
    does dvm (the program computes the value once and stores it twice); updating one in
    place leaves the other."""

    def twice(x):
        return torch.sigmoid(x) + 1, (torch.sigmoid(x) + 1).view(1, 3, 4)

    x = torch.randn(3, 4)
    c = _compiled(twice, x)
    a, b = c(x)
    assert c.vm_calls == 1
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.add_(100)
    torch.testing.assert_close(b, twice(x)[1])


def test_a_view_output_is_its_own_tensor_on_the_same_storage():
    """A view of a region output with the output's own shape is another tensor object (eager's
    view is): changing one's metadata in place leaves the other as it was."""

    def viewed(x):
        y = (x * 2).exp()
        return y, y.view(3, 4)

    x = torch.randn(3, 4)
    c = _compiled(viewed, x)
    y, v = c(x)
    assert c.vm_calls == 1
    assert y is not v
    assert y.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    v.unsqueeze_(0)
    assert y.shape == (3, 4)


@pytest.mark.parametrize("clone_first", [False, True])
def test_a_view_output_keeps_its_base_when_a_clone_of_it_is_an_output(clone_first):
    """The clone's store replaced its base's in the region's table: the later view of ``y``
    became a copy, and ``y.add_`` no longer showed through it."""

    def outputs(x):
        y = x * 2 + 1
        c = y.clone()
        return (c, y, y.view(2, 4)) if clone_first else (y, c, y.unsqueeze(0))

    x = torch.randn(2, 4)
    c = _compiled(outputs, x)
    got = c(x)
    assert c.vm_calls == 1
    y, copy, view = (got[1], got[0], got[2]) if clone_first else got
    assert view.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert copy.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    y.add_(100)
    torch.testing.assert_close(view.reshape(y.shape), y)
    torch.testing.assert_close(copy, x * 2 + 1)


def _squeezed_batch(x):  # attention-like, batch 1: the output is the domain less a size-1 dim
    y = (x.transpose(1, 2) * 2).sigmoid()
    return (y * y.sum(-1, keepdim=True)).squeeze(0).transpose(0, 1).reshape(3, 8)


def _unsqueezed(x):  # the output is the domain with a size-1 dim more
    return (x.t() * 2).exp().unsqueeze(0).transpose(1, 2).reshape(-1)


def _strided_read(x, b):  # the graph reads the output's storage through as_strided
    y = x.t() * 2
    return y.unsqueeze(0) + b, torch.as_strided(y, (5, 4), (4, 1)) + 0


@pytest.mark.parametrize("executor", ["vm", "reference"])
@pytest.mark.parametrize(
    ("fn", "args"),
    [
        (_squeezed_batch, (torch.randn(1, 3, 2, 4),)),
        (_unsqueezed, (torch.randn(5, 4),)),
        (_strided_read, (torch.randn(5, 4), torch.randn(1, 4, 5))),
    ],
    ids=["squeezed", "unsqueezed", "as_strided"],
)
def test_outputs_keep_the_traced_layout_up_to_size_one_dims(monkeypatch, executor, fn, args):
    """An output laid out otherwise than contiguously whose shape is the region's domain up to
    size-1 dims keeps eager's layout: the views traced after it (here a reshape traced as a
    view, an as_strided) read what eager's do."""
    if executor == "reference":
        monkeypatch.setattr(dc, "PREPARE", dc._Reference)
    c = _compiled(fn, *args, min_ops=2)
    got, want = c(*args), fn(*args)
    assert c.vm_calls >= 1
    for g, w in zip(got, want, strict=True) if isinstance(want, tuple) else [(got, want)]:
        torch.testing.assert_close(g, w)


def test_the_dense_layout_check_is_the_definition_and_agrees_with_torch_s():
    """_dense (an output's layout kept when dense) against the definition, the offsets of all
    elements being 0 to numel - 1 once each, for every shape of up to 3 dims from sizes 0-3 and
    strides from 0-13; and against torch's own check, which it replaces, where no stride is 0
    (torch's sorts strides with an order that is not total when one is 0: it calls (2, 1, 2)
    with strides (1, 0, 2) overlapping)."""
    import itertools
    import math

    from torch._prims_common import _is_non_overlapping_and_dense_or_false as torch_s

    cases = dense = 0
    for rank in (1, 2, 3):
        for shape in itertools.product(range(4), repeat=rank):
            indices = list(itertools.product(*map(range, shape)))
            for strides in itertools.product((0, 1, 2, 3, 4, 6, 9, 12, 13), repeat=rank):
                offsets = sorted(
                    sum(i * s for i, s in zip(ix, strides, strict=True)) for ix in indices
                )
                want = offsets == list(range(math.prod(shape)))
                assert dc._dense(shape, strides) == want, (shape, strides)
                if 0 not in strides:
                    assert torch_s(shape, strides) == want, (shape, strides)
                cases += 1
                dense += want
    assert 0 < dense < cases


def test_a_view_of_an_input_is_not_stored_as_a_copy():
    """A graph with in-place ops (compile_graph also takes those, outside AOT autograd): a view
    of an input read in a region and returned stays a view, and sees a later update of the
    input."""

    def update(x):
        v = x.unsqueeze(0)
        y = v * 2 + 1
        x.add_(1)
        return v * 3, y

    x = torch.randn(3, 4)
    c = _compiled(update, x)
    got, want = c(x.clone()), update(x.clone())
    assert c.vm_calls == 2  # y, and v * 3 after the update
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def _filled(op, value, dtype):
    """``(x * 0 + fill) * 2`` with ``fill`` made by aten ``op`` from ``value``."""
    aten = torch.ops.aten

    def fn(x):
        if op == "full":
            fill = aten.full([4], value, dtype=dtype)
        else:
            fill = aten.scalar_tensor(value, dtype=dtype)
        return (x * 0 + fill) * 2

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["scalar_tensor", "full"])
def test_fill_values_past_the_dtype_raise_or_saturate_as_eager(op, dtype):
    """aten.full raises for a finite value its floating dtype cannot hold, aten.scalar_tensor
    only for float32 (a 16-bit one becomes an infinity): the compiled graph does the same."""
    for value in (-1e300, 1e39, 3.4028235e38, 3.39e38, 70000.0, 65504.0, float("inf"), 1.5):
        fn = _filled(op, value, dtype)
        x = torch.ones(4, dtype=dtype)
        compiled = compile_graph(make_fx(fn, tracing_mode="fake")(x), [x], min_ops=1)
        try:
            want = fn(x)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="without overflow"):
                compiled(x)
        else:
            torch.testing.assert_close(compiled(x), want, rtol=0, atol=0, msg=str(value))


@pytest.mark.parametrize("min_ops", [0, -1, 1.5, True, "2", None])
def test_a_bad_min_ops_is_a_value_error(min_ops):
    """0, -1 and 1.5 were taken; "2" and None failed inside and ran the graph eagerly."""
    x = torch.randn(3, 4)
    gm = make_fx(lambda t: t.exp() * 2, tracing_mode="fake")(x)
    with pytest.raises(ValueError, match="min_ops must be an int >= 1"):
        compile_graph(gm, [x], min_ops=min_ops)


def test_an_int_subclass_is_a_min_ops():
    """Past the exact int's fast check, an int's subclass (bool aside) is still taken."""

    class Ops(int):
        pass

    x = torch.randn(3, 4)
    gm = make_fx(lambda t: t.exp() * 2, tracing_mode="fake")(x)
    assert len(compile_graph(gm, [x], min_ops=Ops(2)).regions) == 1
    assert compile_graph(gm, [x], min_ops=Ops(3)).regions == []


def test_a_compiler_bug_runs_the_graph_eagerly_and_boxed(monkeypatch):
    """A compile that raises warns and runs every node eagerly, each a fallback with the
    reason; called boxed (a backward graph), it still takes over and clears the list, so
    saved activations go after their last reader."""

    def broken(gm, nodes, runners):
        raise RuntimeError("simulated scheduler bug")

    monkeypatch.setattr(dc._executor, "schedule", broken)
    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    with pytest.warns(RuntimeWarning, match="could not compile this graph.*simulated scheduler"):
        c = compile_graph(gm, [x, w])
    assert c.runners == []
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n for n, _ in c.fallbacks] == calls
    assert all("simulated scheduler bug" in why for _, why in c.fallbacks)
    args = [x, w]
    torch.testing.assert_close(c.boxed(args), _fn(x, w))
    assert args == []
    torch.testing.assert_close(c(x, w), _fn(x, w))
    assert c.vm_calls == 0


def test_the_common_case_compiles_in_one_c_call(monkeypatch):
    """Where the runners prepare in C, ``compile_graph`` is ``dvm._analysis.compile``'s: no
    Python function runs inside it but the clustering's ``_split_parts`` and the reordering
    schedule, which it calls only for the rare cases they handle."""
    import sys

    from dvm import _analysis, _emitter, cluster

    assert dc._COMPILE is _analysis.compile
    monkeypatch.setattr(cluster, "build_region", _emitter.build_region)  # DVM_NATIVE_ORACLE's
    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    frames: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name != "compile_graph":
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        c = compile_graph(gm, [x, w])
    finally:
        sys.setprofile(None)
    assert frames == []
    assert len(c.runners) == 1
    torch.testing.assert_close(c(x, w), _fn(x, w))


class _AskedSubclass(torch.Tensor):
    asked = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.asked += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_c_compile_reads_values_with_subclass_torch_function_off(monkeypatch):
    """The common case reads the graph's values with subclass torch function handling off (a
    FakeTensor's getters otherwise look ``__torch_function__`` up at every read): a value
    that is a subclass with its own ``__torch_function__`` is not asked, and compiles as the
    plain tensor would."""
    x, w = _inputs()
    plain = compile_graph(make_fx(_fn, tracing_mode="fake")(x, w), [x, w])
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    for node in [n for n in gm.graph.nodes if n.op == "call_function"]:
        fake = node.meta["val"]
        node.meta["val"] = torch.empty(fake.shape, dtype=fake.dtype).as_subclass(_AskedSubclass)
    monkeypatch.setattr(_AskedSubclass, "asked", 0)
    c = compile_graph(gm, [x, w])
    assert _AskedSubclass.asked == 0
    assert [str(r.program) for r in c.regions] == [str(r.program) for r in plain.regions]
    torch.testing.assert_close(c(x, w), _fn(x, w))
    assert c.vm_calls == 1


def test_the_reference_executor_compiles_in_python(monkeypatch):
    """With the reference executor the runners prepare in Python, so the whole compile does."""
    monkeypatch.setattr(dc, "PREPARE", dc._Reference)
    x, w = _inputs()
    c = compile_graph(make_fx(_fn, tracing_mode="fake")(x, w), [x, w])
    assert all(isinstance(r._guarded.__self__, dc._ReferenceLaunch) for r in c.runners)
    torch.testing.assert_close(c(x, w), _fn(x, w))


def _chain_graphs():
    from dvm import benchmarks

    for name, spec in benchmarks.CHAINS.items():
        inputs = list(spec.inputs((4, 16), torch.float32))
        yield name, benchmarks._trace(spec.fn, inputs), inputs, spec.min_ops


@pytest.mark.parametrize("case", list(_chain_graphs()), ids=lambda case: case[0])
def test_the_c_compile_of_the_bench_chains_equals_the_python_path(case, same_as_python_path):
    _, gm, inputs, min_ops = case
    c = compile_graph(gm, inputs, min_ops=min_ops)
    assert len(c.regions) == 1
    same_as_python_path(c, gm, inputs, min_ops=min_ops)


def test_the_c_compile_of_a_tiny_llama_step_equals_the_python_path(tiny_llama, same_as_python_path):
    """A real model's forward and backward graphs (views refused, side effects, splits of the
    schedule): compiled in C as by the Python path, and the step equals eager's."""
    from dvm import benchmarks

    graphs = []

    def compiler(gm, inputs):
        compiled = compile_graph(gm, inputs)
        graphs.append((compiled, gm, list(inputs)))
        return compiled

    model = tiny_llama("sdpa")
    seed = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=seed)
    torch._dynamo.reset()
    step = torch.compile(model, backend=benchmarks.aot_backend(compiler))
    loss = step(input_ids=ids, labels=ids).loss
    loss.backward()
    assert len(graphs) == 2
    for compiled, gm, inputs in graphs:
        assert compiled.regions
        same_as_python_path(compiled, gm, inputs, min_ops=dc.MIN_OPS)
    torch.testing.assert_close(loss, tiny_llama("sdpa")(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize(
    "args",
    [(), (None, None, 2, 0.0, 1), (None, None, "2", 0.0), (None, None, 2, 0)],
    ids=["no-args", "five", "min_ops-str", "t0-int"],
)
def test_the_c_compile_refuses_bad_arguments(args):
    from dvm import _analysis

    with pytest.raises(TypeError, match=r"compile\(gm, graph, min_ops, t0\)"):
        _analysis.compile(*args)


def test_setup_compile_refuses_tables_of_another_analysis():
    from dvm import _analysis, cluster

    with pytest.raises(ValueError, match="setup_compile: 9 tables, not 1"):
        _analysis.setup_compile(
            cluster._Analysis,
            {"index": False},
            cluster,
            None,
            _executor,
            dc.RegionRunner,
            cluster.Clustering,
            dc.CompiledGraph,
            frozenset(),
            ("a", "b", "c"),
            {},
            None,
            None,
            None,
            "vm",
        )


def _outputs_past_the_limit(x):
    from dvm.program import MAX_OUTPUTS

    return tuple((x * k).sin() for k in range(MAX_OUTPUTS + 3))


def _reordered(x):
    a = x.exp()
    b = a.cumsum(-1)  # reads a region value
    y = x.cumsum(0)  # made after b, read by the region
    return b, x.sin() * y + a


def _dead_and_alone(x):
    x.cos()  # dead code
    return x.exp().cumsum(-1)  # the exp, a single op, stays eager


@pytest.mark.parametrize(
    "fn",
    [_outputs_past_the_limit, _reordered, _dead_and_alone],
    ids=["split-outputs", "reordered", "dead-and-alone"],
)
def test_the_c_compile_takes_the_rare_paths_as_python_does(fn, same_as_python_path):
    """A group split at the VM's limits by the merging, a graph the C schedule cannot order in
    place (reordered in Python), dead code and a lone op (a group split when built: test_cluster's
    test_split_when_registers_run_out)."""
    x = torch.randn(3, 5)
    gm = make_fx(fn, tracing_mode="fake")(x)
    c = compile_graph(gm, [x])
    same_as_python_path(c, gm, [x], min_ops=dc.MIN_OPS)
    if fn is _outputs_past_the_limit:
        assert len(c.regions) >= 2
    if fn is _reordered:
        assert _executor.schedule(gm, list(gm.graph.nodes), c.runners) is None
    if fn is _dead_and_alone:
        assert {why for _, why in c.fallbacks} >= {dc.DEAD, dc.ALONE}
    got, want = c(x), fn(x)
    for g, w in zip(*(v if isinstance(v, tuple) else [v] for v in (got, want)), strict=True):
        torch.testing.assert_close(g, w)


def test_the_c_compile_takes_a_min_ops_beyond_a_c_long(same_as_python_path):
    x, w = _inputs()
    gm = make_fx(_fn, tracing_mode="fake")(x, w)
    c = compile_graph(gm, [x, w], min_ops=2**80)
    assert c.regions == []
    assert c.fallbacks
    same_as_python_path(c, gm, [x, w], min_ops=2**80)


def _two_regions(x, w):
    h = torch.sigmoid(x) * x
    return (h @ w).exp() * 2.0 + 1.0


@pytest.fixture
def refused_prepare(monkeypatch):
    """Each runner's preparation (C and Python paths) raising ``error`` for a region with an
    ``exp`` (as the launcher refusing a region its build let through would), the others
    prepared as usual; set up again as it was afterwards."""

    def refuse(error):
        real = dc._PREPARE_REGION

        def prepare(region):
            if any(n.target is aten.exp.default for n in region.nodes):
                raise error
            return real(region)

        monkeypatch.setattr(dc, "_PREPARE_REGION", prepare)
        dc._native_compile()

    yield refuse
    monkeypatch.undo()
    dc._native_compile()


def test_a_region_that_fails_to_prepare_runs_eagerly_alone(refused_prepare, same_as_python_path):
    """A region whose runner raises warns and leaves its own nodes to eager with the reason;
    the graph's other regions still run on the VM, in the C compile as in the Python path."""
    refused_prepare(ValueError("simulated launcher refusal"))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 10, generator=g), torch.randn(10, 7, generator=g)
    gm = make_fx(_two_regions, tracing_mode="fake")(x, w)
    match = "could not prepare a region.*simulated launcher refusal.*3 nodes run eagerly"
    with pytest.warns(RuntimeWarning, match=match):
        c = compile_graph(gm, [x, w])
    [runner] = c.runners
    assert runner.__name__ == "dvm_region_0"
    assert [n.target for n in runner.region.nodes] == [aten.sigmoid.default, aten.mul.Tensor]
    refused = [n for n, why in c.fallbacks if "simulated launcher refusal" in why]
    assert [n.target for n in refused] == [aten.exp.default, aten.mul.Tensor, aten.add.Tensor]
    assert c.regions == c.clustering.regions == [runner.region]
    assert any("simulated launcher refusal" in note for note in c.clustering.notes)
    torch.testing.assert_close(c(x, w), _two_regions(x, w))
    assert (c.vm_calls, c.eager_calls) == (1, 0)
    with pytest.warns(RuntimeWarning, match=match):
        same_as_python_path(c, gm, [x, w], min_ops=dc.MIN_OPS)


def test_an_interrupt_while_preparing_a_region_is_raised(refused_prepare):
    """Only an ``Exception`` leaves a region eager: an interrupt reaches the caller."""
    refused_prepare(KeyboardInterrupt())
    x, w = torch.randn(6, 10), torch.randn(10, 7)
    gm = make_fx(_two_regions, tracing_mode="fake")(x, w)
    with pytest.raises(KeyboardInterrupt):
        compile_graph(gm, [x, w])


@pytest.mark.parametrize("where", ["build_region", "_split_parts"])
def test_a_bug_in_what_the_c_compile_calls_runs_the_graph_eagerly(
    monkeypatch, where, registers_run_out
):
    """An exception other than a build's ValueError, raised by what ``dvm._analysis.compile``
    calls in Python (a group's build, a split), leaves the graph eager with a warning, as a
    bug in the Python path does."""
    from dvm import cluster

    def broken(*args):
        raise RuntimeError(f"simulated bug in {where}")

    x = torch.randn(3, 5)
    fn = registers_run_out if where == "_split_parts" else _fn
    args = [x] if where == "_split_parts" else list(_inputs())
    if where == "_split_parts":
        monkeypatch.setattr(dc, "_split_parts", broken)
        dc._native_compile()  # set up again with the broken split; undone below
    else:
        monkeypatch.setattr(cluster, "build_region", broken)
    try:
        gm = make_fx(fn, tracing_mode="fake")(*args)
        with pytest.warns(RuntimeWarning, match=f"could not compile this graph.*{where}"):
            c = compile_graph(gm, args)
    finally:
        monkeypatch.undo()
        dc._native_compile()
    assert c.runners == []
    torch.testing.assert_close(c(*args), fn(*args))
