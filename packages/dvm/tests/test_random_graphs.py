"""Random elementwise/broadcast/row-reduce graphs (hypothesis): compiled with
``compile_graph`` they equal eager within the dtype's tolerance, and their regions ran on
the VM.

Shapes include size 1 and odd sizes; inputs broadcast along random dims, some are strided
(transposed) views. 16-bit graphs compute in fp32 between an upcast of the inputs and a
downcast of the results, as real graphs do. Conditions (comparisons, where) read inputs
only, so a last-bit difference of a computed value never flips a branch. Every region is
also built by the Python lowering rules alone and checked to be the same (``native_checked``),
and each graph's compile is checked to equal its compile by the Python path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from dvm.cluster import DEAD
from dvm.compile import compile_graph

pytestmark = pytest.mark.usefixtures("native_checked")

SIZES = [1, 2, 3, 5, 8, 17, 33]
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}

UNARY = {
    "neg": torch.neg,
    "abs": torch.abs,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "sin": torch.sin,
    "cos": torch.cos,
    "erf": torch.erf,
    "gelu": torch.nn.functional.gelu,
    "exp": lambda v: torch.exp(v.clamp(-8, 8)),
    "log": lambda v: torch.log(v.abs() + 0.5),
    "log1p": lambda v: torch.log1p(v.abs()),
    "sqrt": lambda v: torch.sqrt(v.abs() + 0.1),
    "rsqrt": lambda v: torch.rsqrt(v.abs() + 0.5),
    "reciprocal": lambda v: torch.reciprocal(v.abs() + 0.5),
    "relu": torch.relu,
    "square": lambda v: v.clamp(-10, 10) ** 2,
    "scale": lambda v: v * 0.75 - 0.25,
}
BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": lambda a, b: a.clamp(-10, 10) * b.clamp(-10, 10),
    "div": lambda a, b: a / (b.abs() + 0.5),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "pow": lambda a, b: (a.abs() + 0.5) ** b.clamp(-2, 2),
}
REDUCE = {
    "sum": lambda v, k: v.sum(-1, keepdim=k),
    "mean": lambda v, k: v.mean(-1, keepdim=k),
    "amax": lambda v, k: v.amax(-1, keepdim=k),
}


def _compatible(a: torch.Size, b: torch.Size) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


@st.composite
def graphs(draw):
    rank = draw(st.integers(1, 3))
    domain = [draw(st.sampled_from(SIZES)) for _ in range(rank)]
    dtype = draw(st.sampled_from(list(TOL)))
    inputs = []
    for _ in range(draw(st.integers(1, 3))):
        keep = draw(st.integers(1, rank))
        shape = [s if draw(st.booleans()) else 1 for s in domain[rank - keep :]]
        transposed = len(shape) >= 2 and draw(st.booleans())
        inputs.append((tuple(shape), transposed))
    steps = []
    n_values = len(inputs)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "where", "scalar"]))
        a = draw(st.integers(0, n_values - 1))
        if kind == "unary":
            steps.append(("unary", draw(st.sampled_from(sorted(UNARY))), a))
        elif kind == "binary":
            steps.append(
                (
                    "binary",
                    draw(st.sampled_from(sorted(BINARY))),
                    a,
                    draw(st.integers(0, n_values - 1)),
                )
            )
        elif kind == "reduce":
            op = draw(st.sampled_from(sorted(REDUCE)))
            steps.append(("reduce", op, a, draw(st.booleans())))
        elif kind == "where":
            steps.append(
                (
                    "where",
                    draw(st.integers(0, len(inputs) - 1)),
                    a,
                    draw(st.integers(0, n_values - 1)),
                    draw(st.sampled_from([-0.3, 0.0, 0.4])),
                )
            )
        else:
            steps.append(("scalar", draw(st.sampled_from([-1.5, 0.5, 2.0])), a))
        n_values += 1
    seed = draw(st.integers(0, 2**16))
    return domain, dtype, inputs, steps, seed


def _make_inputs(inputs, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape, transposed in inputs:
        if transposed:
            t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype).mT
        else:
            t = torch.randn(*shape, generator=g).to(dtype)
        out.append(t)
    return out


def _program(steps, dtype):
    """The graph as a function of its inputs; operands that do not broadcast are skipped."""

    def fn(*xs):
        loaded = [x.float() for x in xs]
        values = list(loaded)
        for step in steps:
            kind = step[0]
            a = values[step[2]]
            if kind == "unary":
                v = UNARY[step[1]](a)
            elif kind == "binary":
                b = values[step[3]]
                v = BINARY[step[1]](a, b) if _compatible(a.shape, b.shape) else a
            elif kind == "reduce":
                v = REDUCE[step[1]](a, step[3])
            elif kind == "where":
                cond = loaded[step[1]] > step[4]
                b = values[step[3]]
                ok = _compatible(a.shape, b.shape)
                ok = ok and _compatible(cond.shape, torch.broadcast_shapes(a.shape, b.shape))
                v = torch.where(cond, a, b) if ok else a
            else:
                v = a * step[1] + step[1]
            values.append(v)
        results = [values[-1], values[len(xs) + len(steps) // 2]]
        return tuple(r.to(dtype) for r in results)

    return fn


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(graphs())
def test_random_graph_equals_eager(same_as_python_path, case):
    _, dtype, inputs, steps, seed = case
    xs = _make_inputs(inputs, dtype, seed)
    fn = _program(steps, dtype)
    gm = make_fx(fn, tracing_mode="fake")(*xs)
    compiled = compile_graph(gm, xs, min_ops=1)  # graphs of one op run on the VM too
    got = compiled(*xs)
    want = fn(*xs)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOL[dtype], equal_nan=True)
    assert compiled.executor == "vm"
    assert compiled.eager_calls == 0
    assert compiled.vm_calls == len(compiled.regions)
    # every op of these graphs lowers; the steps no result reads are dead code, left as it is
    assert all(why == DEAD for _, why in compiled.fallbacks)
    same_as_python_path(compiled, gm, xs, min_ops=1)
