"""Graphs with symbolic sizes: compiled again for each set of sizes they run with, equal to
eager, regions on the VM; a set that cannot be specialised runs eagerly with one warning."""

from __future__ import annotations

import math
import operator
import threading
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dvm.backend import make_backend
from dvm.compile import CompiledGraph, compile_graph
from dvm.specialize import LIMIT, Specializing, bindings, symbolic_inputs

aten = torch.ops.aten


def _fn(x, w):
    h = (x * w).view(x.shape[0] * x.shape[1], x.shape[2])
    return torch.softmax(h * 0.5, -1).sigmoid() + 1, x.shape[1] * 2


def _symbolic(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


class _Compiles:
    def __init__(self, fail: bool = False) -> None:
        self.graphs: list[CompiledGraph] = []
        self.fail = fail

    def __call__(self, gm, args):
        if self.fail:
            raise RuntimeError("no compile today")
        self.graphs.append(compile_graph(gm, args))
        return self.graphs[-1]


def test_each_set_of_sizes_compiles_once_and_equals_eager():
    w = torch.randn(8)
    gm = _symbolic(_fn, torch.randn(2, 3, 8), w)
    assert symbolic_inputs(gm) == [0, 1]
    compiles = _Compiles()
    spec = Specializing(gm, compiles)
    shapes = [(2, 3, 8), (4, 5, 8), (2, 3, 8), (1, 7, 8)]
    for shape in shapes:
        x = torch.randn(*shape)
        got, want = spec(x, w), _fn(x, w)
        torch.testing.assert_close(got[0], want[0])
        assert got[1] == want[1]
    x = torch.randn(4, 5, 8)
    args = [x, w]
    got = spec.boxed(args)  # AOT autograd's convention: the list is handed over and cleared
    assert args == []
    torch.testing.assert_close(got[0], _fn(x, w)[0])
    assert len(compiles.graphs) == 3 == len(spec.compiled) == len(spec.specialize_us)
    assert [g.vm_calls for g in compiles.graphs] == [2, 2, 1]
    for g, (b, s, d) in zip(compiles.graphs, [(2, 3, 8), (4, 5, 8), (1, 7, 8)], strict=True):
        (region,) = g.regions
        assert math.prod(region.domain) == b * s * d
        assert region.domain[-1] == d
        for view in [n for n in g.run.steps if n.fn is aten.view.default]:
            assert view.args[1] == [b * s, d]  # ints: the nodes computing them are gone
        assert aten.sym_size.int not in g.run.targets
        assert operator.mul not in g.run.targets


def test_two_threads_specialising_new_sizes_at_once_all_compile():
    w = torch.randn(8)
    spec = Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), _Compiles(), limit=64)
    errors = []

    def calls(first: int) -> None:
        try:
            for b in range(first, first + 24):
                x = torch.randn(b, 3, 8)
                torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
        except Exception as e:  # reported below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(first,)) for first in (1, 13)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert errors == []
    assert spec.failures == {}
    assert len(spec.compiled) == 36


def test_the_least_recently_used_sizes_are_dropped_past_the_limit():
    """A set of sizes whose compile was dropped and comes back is compiled again, and one set
    more is kept from then on: a loop over more sets than kept stops recompiling."""
    w = torch.randn(8)
    compiles = _Compiles()
    spec = Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), compiles, limit=2)
    for s in (3, 4, 3, 5, 3):
        spec(torch.randn(2, s, 8), w)
    assert len(compiles.graphs) == 3  # 3, 4, 5: 5 came after 3 was used, so 4 was dropped
    assert [k[0][0] for k in spec.compiled] == [(2, 5, 8), (2, 3, 8)]
    assert [k[0][0] for k in spec.dropped] == [(2, 4, 8)]
    for _ in range(3):
        for s in (3, 4, 5):
            x = torch.randn(2, s, 8)
            torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
    assert len(compiles.graphs) == 4  # 4 once more, then all three kept
    assert (spec.limit, len(spec.compiled), spec.dropped, spec.eager_calls) == (3, 3, set(), 0)
    with pytest.raises(ValueError, match="limit must be at least 1"):
        Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), compiles, limit=0)
    with pytest.raises(ValueError, match="compiles must be at least 1"):
        Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), compiles, compiles=0)


def test_a_graph_compiles_at_most_compiles_sets():
    """A stream of ever new sizes (a server's) compiles ``compiles`` different sets, then runs
    new ones eagerly, with one warning: its compiles, their records and what torch keeps of
    them stay bounded. A dropped set that comes back is still compiled once more."""
    w = torch.randn(8)
    compiles = _Compiles()
    spec = Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), compiles, limit=2, compiles=5)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for s in (*range(2, 11), 2, 5, 6):  # 7 to 10 past the cap; 2 dropped; 5 and 6 kept
            x = torch.randn(1, s, 8)
            torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
    assert [str(r.message) for r in rec] == [spec.eager_reason]
    assert rec[0].category is RuntimeWarning
    assert "has compiled 5 sets of sizes, the most it may" in spec.eager_reason
    assert 'options={"size_limit": N}' in spec.eager_reason
    assert len(compiles.graphs) == len(spec.specialize_us) == 6
    assert (len(spec.compiled), len(spec.dropped), spec.eager_calls) == (3, 2, 4)
    assert [k[0][0][1] for k in spec.compiled] == [2, 5, 6]  # least recently used first


def test_a_boxed_call_run_eagerly_clears_its_list():
    """AOT autograd's boxed convention (a backward graph frees saved activations as it goes):
    a call past ``compiles``, or of a set that failed to specialise, ran ``gm.forward`` on the
    list and left it full."""
    w = torch.randn(8)
    for fail, cap in ((False, 1), (True, 8)):
        gm = _symbolic(_fn, torch.randn(2, 3, 8), w)
        spec = Specializing(gm, _Compiles(fail=fail), compiles=cap)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            spec(torch.randn(2, 3, 8), w)
            for s in (4, 5):  # past the cap (or failing): eager
                x = torch.randn(2, s, 8)
                args = [x, w]
                got = spec.boxed(args)
                assert args == []
                torch.testing.assert_close(got[0], _fn(x, w)[0])
                assert got[1] == _fn(x, w)[1]
        assert (spec.eager_calls, len(spec.failures)) == ((0, 3) if fail else (2, 0))


def test_calls_past_the_cap_are_seen_and_counted():
    """The calls past ``compiles`` ran eagerly unseen: ``on_eager`` (the backend's
    ``on_compile``) now gets the graph they run, once, every call node a fallback naming
    ``size_limit``, and its ``eager_calls`` count them."""
    w = torch.randn(8)
    seen: list[CompiledGraph] = []
    spec = Specializing(
        _symbolic(_fn, torch.randn(2, 3, 8), w), _Compiles(), compiles=2, on_eager=seen.append
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for s in (3, 4, 5, 6, 3, 7):
            x = torch.randn(1, s, 8)
            torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
    assert seen == [spec.eager]
    assert (spec.eager.eager_calls, spec.eager.vm_calls, spec.eager_calls) == (3, 0, 3)
    assert spec.eager.regions == []
    assert spec.eager.fallbacks
    assert {why for _, why in spec.eager.fallbacks} == {spec.eager_reason}

    graphs: list[tuple[str, CompiledGraph]] = []
    backend = make_backend(lambda kind, c: graphs.append((kind, c)), size_limit=1)
    compiled = torch.compile(_chain, backend=backend, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for n in (2, 3, 4):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), _chain(x))
    assert [(kind, c.vm_calls, c.eager_calls) for kind, c in graphs] == [
        ("inference", 1, 0),
        ("inference", 0, 2),
    ]
    assert all("size_limit" in why for _, why in graphs[1][1].fallbacks)


def test_a_loop_over_as_many_sets_as_it_may_compile_keeps_them_all():
    """The cap counts different sets, not compiles: a loop over ``compiles`` sets, more than
    kept at first, ends with every set kept although the dropped ones compiled twice."""
    w = torch.randn(8)
    compiles = _Compiles()
    spec = Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), compiles, limit=2, compiles=4)
    for _ in range(3):
        for s in (2, 3, 4, 5):
            x = torch.randn(1, s, 8)
            torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
    assert len(compiles.graphs) == 6  # 2 and 3 dropped in the first pass, then kept
    assert (len(spec.compiled), spec.dropped, spec.eager_calls) == (4, set(), 0)


def _chain(x):
    return torch.softmax(x * 2 + 1, -1).sigmoid() * x


@pytest.mark.parametrize("size_limit", [None, 5])
def test_a_loop_over_more_sizes_than_kept_compiles_each_once_more_at_most(
    backend_compiles, size_limit
):
    """A loop over more sets of sizes than a graph keeps compiled (16 at first; lengths
    bucketed by batch) was compiled again at every call (3 ms and ~1.3 KB torch never frees,
    each): now a dropped set that comes back is kept from then on, and ``size_limit`` bounds
    the compiles, the sets past it running eagerly with one warning."""
    graphs = backend_compiles
    options = None if size_limit is None else {"size_limit": size_limit}
    compiled = torch.compile(_chain, backend="dvm", dynamic=True, options=options)
    rows = range(2, LIMIT + 4)  # two sets past those kept at first
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            for n in rows:
                x = torch.randn(n, 8)
                torch.testing.assert_close(compiled(x), _chain(x))
    warned = [r for r in rec if "the most it may" in str(r.message)]
    if size_limit is None:
        assert len(graphs) == len(rows) + 2  # the two dropped sets once more
        assert sum(g.vm_calls for g in graphs) == 3 * len(rows)
        assert warned == []
    else:
        assert len(graphs) == size_limit
        assert [g.vm_calls for g in graphs] == [3] * size_limit
        assert len(warned) == 1
        assert warned[0].category is RuntimeWarning


def test_specialising_new_sizes_adds_nothing_to_torchs_fake_tensor_cache():
    """torch's fake-tensor dispatch cache is shared by every fake mode and never shrinks: an
    entry (~2.5 KB) for each set of sizes specialised would grow without bound in a server fed
    ever new lengths."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = torch.randn(8)
    spec = Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), _Compiles(), limit=2)
    spec(torch.randn(2, 3, 8), w)
    before = len(FakeTensorMode.cache)
    for s in range(4, 14):
        x = torch.randn(2, s, 8)
        torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
    assert len(FakeTensorMode.cache) == before


def test_a_failed_specialisation_runs_eagerly_with_one_warning():
    w = torch.randn(8)
    spec = Specializing(_symbolic(_fn, torch.randn(2, 3, 8), w), _Compiles(fail=True))
    x = torch.randn(2, 3, 8)
    with pytest.warns(RuntimeWarning, match="could not specialise.*no compile today"):
        got = spec(x, w)
    torch.testing.assert_close(got[0], _fn(x, w)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x = torch.randn(3, 3, 8)
        torch.testing.assert_close(spec(x, w)[0], _fn(x, w)[0])
    got = spec.boxed([x, w])  # the eager fallback takes a boxed call too
    torch.testing.assert_close(got[0], _fn(x, w)[0])
    assert len(spec.failures) == 2
    assert all("no compile today" in why for why in spec.failures.values())


def test_inputs_that_disagree_with_the_graphs_sizes_run_eagerly():
    """Traced with equal sizes, ``x`` and ``y`` share their size symbols; called with
    different ones, no concrete graph fits: eager, with the reason."""

    def two(x, y):
        return x.sin() * 2 + 1, y.cos() * 2 + 1

    gm = _symbolic(two, torch.randn(2, 3), torch.randn(2, 3))
    x, y = torch.randn(2, 3), torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"input 1 is \(2, 4\); the graph's sizes make it"):
        bindings([n for n in gm.graph.nodes if n.op == "placeholder"], [x, y], [0, 1])
    spec = Specializing(gm, _Compiles())
    with pytest.warns(RuntimeWarning, match="could not specialise"):
        got = spec(x, y)
    for g, w in zip(got, two(x, y), strict=True):
        torch.testing.assert_close(g, w)


def test_inputs_with_other_strides_than_traced_are_compiled():
    """An input may come with other strides than the graph's (a backward graph's tangent
    does: Swin v2's under ``dynamic=True``): its sizes pick the compile, the VM reads its real
    strides, no warning."""

    def two(x, y):
        return x.sin() * 2 + y

    gm = _symbolic(two, torch.randn(3, 10)[:, :4], torch.randn(3, 10)[:, :4])
    x, y = torch.randn(3, 4), torch.randn(3, 12)[:, :4]  # strides (4, 1) and (12, 1)
    compiles = _Compiles()
    spec = Specializing(gm, compiles)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(spec(x, y), two(x, y))
    assert not spec.failures
    assert [g.vm_calls for g in compiles.graphs] == [1]


@pytest.mark.parametrize("dynamic", [True, None])
def test_tiny_llama_with_changing_lengths_runs_regions_on_the_vm(dynamic, tiny_llama):
    """``dynamic=True``, and dynamo's automatic dynamic shapes (``None``: static first, then
    symbolic once a second length comes): every length's loss and gradients equal eager and
    its forward and backward regions run on the VM."""
    model = tiny_llama()
    graphs: list[tuple[str, CompiledGraph]] = []
    compiled = torch.compile(
        model, backend=make_backend(lambda kind, c: graphs.append((kind, c))), dynamic=dynamic
    )
    g = torch.Generator().manual_seed(1)
    for length in (8, 11, 17, 11):
        ids = torch.randint(0, 128, (2, length), generator=g)
        want = model(input_ids=ids, labels=ids)
        want.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        got = compiled(input_ids=ids, labels=ids)
        got.loss.backward()
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], atol=1e-5, rtol=1e-4, msg=n)
        model.zero_grad()
    kinds = [kind for kind, _ in graphs]
    assert kinds.count("forward") == kinds.count("backward") == 3  # one a length, 11 reused
    for _, c in graphs:
        assert c.regions
        assert not any("dynamic shape" in why for _, why in c.fallbacks)
        assert c.eager_calls == 0
    # each region ran once a step of its length: length 11 (the second compiles) twice
    assert [c.vm_calls for _, c in graphs] == [
        len(c.regions) * n for (_, c), n in zip(graphs, [1, 1, 2, 2, 1, 1], strict=True)
    ]


def test_sizes_from_data_leave_only_their_nodes_eager():
    """After ``nonzero`` (captured by dynamo), the masked values' sizes come from data: those
    nodes stay eager with the reason; the rest of the graph runs on the VM, no warning."""
    graphs: list[CompiledGraph] = []

    def fn(x):
        y = x[x > 0]
        return (y.sigmoid() * y + 1).sum(), x.sin() * 2 + x

    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(
            fn, backend=make_backend(lambda _, c: graphs.append(c)), dynamic=True
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for n in (6, 9):
                x = torch.randn(4, n)
                for g, w in zip(compiled(x), fn(x), strict=True):
                    torch.testing.assert_close(g, w)
    assert [c.vm_calls for c in graphs] == [1, 1]
    for c in graphs:
        (region,) = c.regions
        assert aten.sin.default in {n.target for n in region.nodes}
        eager = {n.target for n, why in c.fallbacks if "dynamic shape" in why}
        assert aten.sigmoid.default in eager
