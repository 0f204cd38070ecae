"""dvm._launcher.prepare, a region's runner prepared in one C call: it binds what the runner's
Python preparation (``dvm.vm.Kernel``, its ``bind`` and ``dvm.compile._out_layouts``) binds,
and bad regions and set-ups raise."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dvm import _launcher, _lib, benchmarks, vm
from dvm import compile as dc
from dvm.cluster import Region
from dvm.program import REDUCTIONS, Instr, Op, Program


class _PythonKernel(vm.Kernel):
    """``vm.Kernel`` under another name: the runner prepares through it in Python (``made``
    counts the kernels it made)."""

    made = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        type(self).made += 1


def _runners(gm, inputs, monkeypatch, python: bool) -> list[dc.RegionRunner]:
    with monkeypatch.context() as m:
        if python:
            m.setattr(dc, "PREPARE", _PythonKernel)
        return dc.compile_graph(gm, inputs, min_ops=1).runners


def _same_runs(direct: dc.RegionRunner, python: dc.RegionRunner, args) -> None:
    assert direct._inputs == python._inputs
    assert direct._results == python._results
    bound, want = direct._guarded.__self__, python._guarded.__self__
    assert (bound.shapes, bound.dtypes) == (want.shapes, want.dtypes)
    got, expected = direct._guarded(args, direct._results), python(*args)
    for g, w in zip(got, expected, strict=True):
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chain", list(benchmarks.CHAINS))
def test_prepare_binds_what_the_python_preparation_binds(monkeypatch, chain, dtype):
    inputs = list(benchmarks.CHAINS[chain].inputs((6, 10), dtype))
    gm = benchmarks._trace(benchmarks.CHAINS[chain].fn, inputs)
    made = _PythonKernel.made
    direct = _runners(gm, inputs, monkeypatch, python=False)
    assert _PythonKernel.made == made
    python = _runners(gm, inputs, monkeypatch, python=True)
    assert direct
    assert len(direct) == len(python) == _PythonKernel.made - made
    for d, p in zip(direct, python, strict=True):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        env = dict(zip(placeholders, inputs, strict=True))
        args = [env.get(n) for n in d._inputs]
        if all(a is not None for a in args):
            _same_runs(d, p, args)


def _setup(rewrite) -> None:
    level = _lib.library()[1]
    _launcher.setup_regions(
        _lib.run_address(level), _lib.max_row(level), REDUCTIONS, vm._CASTS, rewrite
    )


def test_the_cast_rewrite_is_asked_only_of_programs_that_round():
    """``without_redundant_casts`` is asked once per region that rounds (a bf16 RMSNorm's),
    never for fp32; a cast stored at once into a bf16 output is dropped, the output the same."""
    asked = []

    def spy(program, out_dtypes):
        kept = vm.without_redundant_casts(program, out_dtypes)
        asked.append((tuple(out_dtypes), len(program.encode()[1]), len(kept.encode()[1])))
        return kept

    chain = benchmarks.CHAINS["rms_norm"]
    _setup(spy)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = list(chain.inputs((6, 10), dtype))
            gm = benchmarks._trace(chain.fn, inputs)
            (runner,) = dc.compile_graph(gm, inputs, min_ops=1).runners
            torch.testing.assert_close(runner(*inputs)[0], chain.fn(*inputs))
        assert asked == [((torch.bfloat16,), 11, 11)]
        rounds = Program(
            (Instr(Op.LOAD, 0, 0), Instr(Op.CAST_BF16, 1, 0), Instr(Op.STORE, -1, 0, 1)), 1, 1, 2
        )
        out = torch.empty(6, 10, dtype=torch.bfloat16)
        region = _region((6, 10), out, program=rounds, out_dtypes=[torch.bfloat16])
        guarded, _, results = _launcher.prepare(region)
        x = torch.randn(6, 10)
        assert torch.equal(guarded([x], results)[0], x.to(torch.bfloat16))
    finally:
        dc._direct_preparation()
    assert asked[1:] == [((torch.bfloat16,), 3, 2)]


class _Node:
    """A graph node as prepare() reads it: its traced value in ``meta``."""

    def __init__(self, val: torch.Tensor | None) -> None:
        self.meta = {} if val is None else {"val": val}

    def __repr__(self) -> str:
        return "_Node"


_COPY = Program((Instr(Op.LOAD, 0, 0), Instr(Op.STORE, -1, 0, 0)), 1, 1, 1)


def _region(size, out: torch.Tensor, **change) -> Region:
    x = _Node(torch.empty(size))
    region = Region([], [x], [size], [_Node(out)], [0], size, _COPY, [torch.float32], [False], 0.0)
    return replace(region, **change)


def _layouts():
    """Each output layout over a few domains: shapes equal to the domain up to size-1 dims,
    strides of every dim order (dense), with a gap, with a 0 (expanded)."""
    for domain in ((2, 3, 4), (1, 3, 4), (2, 1, 4), (3, 1), (5,)):
        own = [n for n in domain if n != 1]
        for shape in {domain, tuple(own), (1, *own), (*own, 1), (own[0], 1, *own[1:])}:
            for order in itertools.permutations(range(len(shape))):
                strides = [0] * len(shape)
                step = 1
                for d in reversed(order):
                    strides[d] = step
                    step *= shape[d]
                yield domain, shape, tuple(strides)
                yield domain, shape, tuple(2 * s for s in strides)
                yield domain, shape, tuple(0 if k == order[0] else s for k, s in enumerate(strides))


def test_output_layouts_are_the_python_preparation_s(monkeypatch):
    """Every output layout of :func:`_layouts`, prepared in C and in Python
    (``_out_layouts``, ``_dense``, ``_over_domain``), allocates the same outputs."""
    cases = kept = 0
    for domain, shape, strides in _layouts():
        size = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
        out = torch.empty(size).as_strided(shape, strides)
        region = _region(domain, out)
        direct = dc.RegionRunner(region, 0)
        with monkeypatch.context() as m:
            m.setattr(dc, "PREPARE", _PythonKernel)
            python = dc.RegionRunner(region, 0)
        x = torch.randn(domain)
        _same_runs(direct, python, [x])
        cases += 1
        kept += not direct._guarded([x], ((0, None),))[0].is_contiguous()
    assert cases > 100
    assert kept > 0


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"output_slots": [1]}, ValueError, "output slot 1 of a program with 1 outputs"),
        ({"output_slots": [0, 0]}, ValueError, "1 outputs and 2 output slots"),
        ({"input_views": []}, ValueError, "1 input nodes and 0 input views"),
        ({"input_nodes": [_Node(None)]}, ValueError, r"node _Node has no traced value"),
        ({"out_dtypes": [torch.float64]}, TypeError, "output 0 has dtype torch.float64"),
        ({"out_dtypes": []}, ValueError, "give 1 out_dtypes and reduced flags"),
        ({"reduced": 3}, TypeError, "reduced: give a sequence"),
        ({"domain": (2, 3, 4, 1, 1, 1, 1)}, ValueError, "need 1 to 6"),
        ({"domain": (2, 5)}, ValueError, "more than the domain"),
        ({"outputs": [_Node(torch.empty(4, 3, 2))]}, ValueError, r"shape \(4, 3, 2\) is not"),
    ],
)
def test_a_bad_region_raises(change, error, match):
    with pytest.raises(error, match=match):
        _launcher.prepare(_region((2, 3, 4), torch.empty(2, 3, 4), **change))


def test_prepare_takes_a_region():
    with pytest.raises(AttributeError, match="program"):
        _launcher.prepare(object())
    with pytest.raises(TypeError):
        _launcher.prepare()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((0, 1, (), (), vm.without_redundant_casts), ValueError, "run_address is null"),
        ((1, 1, (), (), None), TypeError, "must be callable"),
        ((1, 1, (300,), (), vm.without_redundant_casts), ValueError, "opcode 300"),
        ((1, 1, (), 5, vm.without_redundant_casts), TypeError, "casts: give a sequence"),
        (("1", 1, (), (), vm.without_redundant_casts), TypeError, "int"),
    ],
)
def test_bad_set_ups_raise_and_change_nothing(args, error, match):
    with pytest.raises(error, match=match):
        _launcher.setup_regions(*args)
    x = torch.randn(6, 10)
    gm = benchmarks._trace(benchmarks.CHAINS["softmax"].fn, [x])
    c = dc.compile_graph(gm, [x], min_ops=1)
    torch.testing.assert_close(c(x)[0] if isinstance(c(x), tuple) else c(x), torch.softmax(x, -1))
    assert c.vm_calls == 2


def _fake_region(domain, shape, strides, mode, graph, kind=Region) -> Region:
    """:func:`_region` over torch.fx Nodes holding FakeTensors (the values a traced graph
    holds, which prepare() reads through the types setup_regions resolved)."""
    x, out = graph.placeholder("x"), graph.placeholder("out")
    with mode:
        x.meta["val"] = torch.empty(domain)
        out.meta["val"] = torch.empty_strided(shape, strides)
    return kind([], [x], [domain], [out], [0], domain, _COPY, [torch.float32], [False], 0.0)


class _SubRegion(Region):
    """A Region of another type: prepare() reads its fields by name."""


def test_direct_reads_agree_with_the_generic_ones(monkeypatch):
    """Fake values in torch.fx Nodes, read directly (a Node's meta, a FakeTensor's shape,
    dtype and strides, a Region's and a Program's fields), bind what the Python preparation
    binds; a Region subclass and a set-up without types, read by name, the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode, graph = FakeTensorMode(), torch.fx.Graph()
    cases = kept = 0
    for domain, shape, strides in itertools.islice(_layouts(), 0, None, 7):
        region = _fake_region(domain, shape, strides, mode, graph)
        direct = dc.RegionRunner(region, 0)
        by_name = dc.RegionRunner(_fake_region(domain, shape, strides, mode, graph, _SubRegion), 0)
        with monkeypatch.context() as m:
            m.setattr(dc, "PREPARE", _PythonKernel)
            python = dc.RegionRunner(region, 0)
        x = torch.randn(domain)
        _same_runs(direct, python, [x])
        assert by_name._results == direct._results
        kept += not direct._guarded([x], ((0, None),))[0].is_contiguous()
        cases += 1
    assert cases > 10
    assert kept > 0
    _setup(vm.without_redundant_casts)  # no types: every read by name
    try:
        region = _fake_region((2, 3, 4), (2, 3, 4), (1, 2, 6), mode, graph)
        plain = dc.RegionRunner(region, 0)
        assert plain._results == ((0, None),)
        assert plain._guarded.__self__.shapes == (torch.Size((2, 3, 4)),)
        assert not plain._guarded([torch.randn(2, 3, 4)], plain._results)[0].is_contiguous()
    finally:
        dc._direct_preparation()


@pytest.mark.parametrize(
    ("types", "error", "match"),
    [
        (5, TypeError, "types: give a tuple or None, got int"),
        ((1, 2, 3, 4), TypeError, "types: .Node, FakeTensor, Region, Program."),
        ((torch.fx.Node,), TypeError, "types: .Node, FakeTensor, Region, Program."),
    ],
)
def test_bad_types_raise_and_change_nothing(types, error, match):
    level = _lib.library()[1]
    with pytest.raises(error, match=match):
        _launcher.setup_regions(
            _lib.run_address(level),
            _lib.max_row(level),
            REDUCTIONS,
            vm._CASTS,
            vm.without_redundant_casts,
            types,
        )
    x = torch.randn(6, 10)
    gm = benchmarks._trace(benchmarks.CHAINS["softmax"].fn, [x])
    c = dc.compile_graph(gm, [x], min_ops=1)
    torch.testing.assert_close(c(x)[0] if isinstance(c(x), tuple) else c(x), torch.softmax(x, -1))
