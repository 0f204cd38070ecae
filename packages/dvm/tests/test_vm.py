"""The C++ VM against dvm.program.run_reference (plain PyTorch) and against torch in float64.

Tolerances: ops that only move, compare, select or round (loads, stores, casts, neg, abs,
add/sub/mul/div, max/min, comparisons, where, not/and/or) must equal the reference exactly.
Transcendentals are the VM's own code (and its sqrt is correctly rounded, torch's CPU sqrt
not always): fp32 outputs within 4e-7 relative + 1e-7 absolute of the reference (a few
ulp), 16-bit outputs within one ulp of their dtype (a few fp32 ulp can flip a rounding).
Row reductions sum in another order than torch: ROW_TOL. The ulp bounds themselves are checked
against float64 torch in ``test_math_accuracy``.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import pathlib
import platform
import re
import shutil
import subprocess

import pytest
import torch

from dvm import _lib, vm
from dvm.program import BINARY, UNARY, Instr, Op, Program, run_reference

EXACT = {
    Op.NEG, Op.ABS, Op.NOT, Op.CAST_BF16, Op.CAST_F16, Op.ADD, Op.SUB, Op.MUL, Op.DIV,
    Op.MAX, Op.MIN, Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE, Op.AND, Op.OR,
}  # fmt: skip
TOL = {  # output dtype -> (rtol, atol) for the VM's own transcendentals
    torch.float32: (4e-7, 1e-7),
    torch.bfloat16: (2**-7, 1e-7),
    torch.float16: (2**-10, 1e-7),
}
SPECIALS = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, math.inf, -math.inf, math.nan, 1e-40, -1e-30,
            1e-7, 88.0, 89.5, -88.0, -104.0, 1e4, -1e4, 3e38, 65504.0, 70000.0]  # fmt: skip
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def unary_tol(op: Op) -> dict[torch.dtype, tuple[float, float]]:
    """TOL, with GELU's absolute error wider: erf's absolute error times |x| / 2."""
    if op is Op.GELU:
        return {dtype: (rtol, 4e-6) for dtype, (rtol, _) in TOL.items()}
    return TOL


def program(*instrs: Instr, n_inputs: int, n_outputs: int = 1) -> Program:
    n_regs = 1 + max(i.dst for i in instrs)
    return Program(tuple(instrs), n_inputs, n_outputs, n_regs)


def unary(op: Op) -> Program:
    return program(Instr(Op.LOAD, 0, 0), Instr(op, 1, 0), Instr(Op.STORE, -1, 0, 1), n_inputs=1)


def binary(op: Op) -> Program:
    return program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 1, 1),
        Instr(op, 2, 0, 1),
        Instr(Op.STORE, -1, 0, 2),
        n_inputs=2,
    )


def values(n: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    """n fp32 values: the special ones, then normal random ones."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(max(n - len(SPECIALS), 0), generator=g) * scale
    return torch.cat([torch.tensor(SPECIALS), rand])[:n]


def check(program: Program, inputs, domain, out_dtypes, reduced=None, exact=False, tol=TOL):
    got = vm.run(program, inputs, domain, out_dtypes, reduced)
    want = run_reference(program, inputs, domain, out_dtypes, reduced)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        assert g.is_contiguous()
        if exact or g.dtype == torch.bool:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
        else:
            rtol, atol = tol[g.dtype]
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(UNARY), ids=lambda op: op.name)
def test_unary(op: Op, dtype: torch.dtype) -> None:
    x = values(3001, seed=int(op)).to(dtype)
    if op in (Op.LOG, Op.LOG1P, Op.SQRT, Op.RSQRT):
        x = torch.cat([x, x.abs()])  # mostly inside the domain too
    check(unary(op), [x], x.shape, [dtype], exact=op in EXACT, tol=unary_tol(op))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(BINARY), ids=lambda op: op.name)
def test_binary(op: Op, dtype: torch.dtype) -> None:
    a = values(2000, seed=int(op)).to(dtype)
    b = values(2000, seed=int(op) + 1000).to(dtype)[torch.randperm(2000)]
    if op is Op.POW:
        b = torch.cat([b[:1000], b[1000:].round()])  # integral exponents, negative bases
    else:
        b[::7] = a[::7]  # equal pairs for the comparisons
    check(binary(op), [a, b], a.shape, [dtype], exact=op in EXACT)


def test_pow_special_cases_match_c99() -> None:
    sp = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, math.inf,
                       -math.inf, math.nan, 1e-40, 100.0, 1e10, -1e10, 2.5])  # fmt: skip
    a, b = sp.repeat_interleave(len(sp)), sp.repeat(len(sp))
    got = vm.run(binary(Op.POW), [a, b], a.shape, [torch.float32])[0]
    want = torch.pow(a, b)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=0, equal_nan=True)
    assert torch.equal(got.signbit(), want.signbit()) or bool(
        (got.isnan() | ~got.signbit().ne(want.signbit())).all()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.bool])
def test_where_and_logic_with_bool_inputs(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    cond = torch.rand(513, generator=g) > 0.5
    a, b = values(513, 1).to(dtype) if dtype != torch.bool else cond.flip(0), values(513, 2)
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 1, 1),
        Instr(Op.LOAD, 2, 2),
        Instr(Op.WHERE, 3, 0, 1, 2),
        Instr(Op.AND, 4, 0, 1),
        Instr(Op.OR, 5, 0, 2),
        Instr(Op.NOT, 6, 0),
        Instr(Op.LT, 7, 1, 2),
        Instr(Op.STORE, -1, 0, 3),
        Instr(Op.STORE, -1, 1, 4),
        Instr(Op.STORE, -1, 2, 5),
        Instr(Op.STORE, -1, 3, 6),
        Instr(Op.STORE, -1, 4, 7),
        n_inputs=3,
        n_outputs=5,
    )
    outs = [torch.float32, torch.bool, torch.bool, torch.bool, torch.bfloat16]
    got = check(p, [cond, a, b], cond.shape, outs, exact=True)
    torch.testing.assert_close(got[0], torch.where(cond, a.float(), b), equal_nan=True)
    assert torch.equal(got[4], (a.float() < b).bfloat16())


# (domain, input shapes): scalars, size-1 dims, row and column broadcast, odd sizes
BROADCASTS = [
    ((1,), [(1,), ()]),
    ((3,), [(3,), (1,)]),
    ((7, 5), [(7, 5), (5,)]),
    ((7, 5), [(7, 1), (1, 5)]),
    ((4, 1, 6), [(4, 1, 6), ()]),
    ((2, 3, 4, 5), [(3, 1, 5), (2, 1, 4, 1)]),
    ((1, 1, 1000), [(1000,), (1, 1, 1)]),
    ((2, 1, 3, 1, 2, 257), [(1, 3, 1, 1, 257), (2, 1, 1, 1, 2, 1)]),
    ((3000, 3), [(3000, 3), (3,)]),
    ((3, 3000), [(3, 1), (3000,)]),
]


@pytest.mark.parametrize(("domain", "shapes"), BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_patterns(domain, shapes, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(domain))
    a, b = (torch.randn(s, generator=g).to(dtype) for s in shapes)
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 1, 1),
        Instr(Op.MUL, 2, 0, 1),
        Instr(Op.CONST, 3, imm=0.5),
        Instr(Op.ADD, 2, 2, 3),
        Instr(Op.STORE, -1, 0, 2),
        Instr(Op.STORE, -1, 1, 1),
        n_inputs=2,
        n_outputs=2,
    )
    check(p, [a, b], domain, [dtype, torch.float32], exact=True)


def test_non_contiguous_inputs() -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(64, 96, generator=g)
    views = {
        "transposed": base[:, :80].t(),  # (80, 64), strides (1, 96)
        "sliced": base[::3, 1::2][:, :40].t().contiguous().t(),  # (22, 40), column-major copy
        "stepped": base[1::2, ::3][:, :16].reshape(32, 16)[:, :16],
        "expanded": base[:1, :64].expand(80, 64),
    }
    for name, x in views.items():
        y = torch.randn(x.shape, generator=g).bfloat16()
        p = binary(Op.SUB)
        got = check(p, [x, y], x.shape, [torch.float32], exact=True)[0]
        assert torch.equal(got, x - y.float()), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_registers_read_again_and_stored_twice(dtype: torch.dtype) -> None:
    # fp32 results go straight into their output; later instructions then read them there
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.EXP, 1, 0),
        Instr(Op.STORE, -1, 0, 1),
        Instr(Op.MUL, 2, 1, 1),
        Instr(Op.STORE, -1, 1, 2),
        Instr(Op.STORE, -1, 2, 1),
        Instr(Op.NEG, 1, 2),
        Instr(Op.STORE, -1, 3, 1),
        n_inputs=1,
        n_outputs=4,
    )
    x = values(5000, seed=9, scale=2.0)
    out = check(p, [x], x.shape, [dtype] * 4)
    torch.testing.assert_close(out[0], out[2], rtol=0, atol=0, equal_nan=True)


def test_casts_stored_into_their_dtype_are_dropped() -> None:
    # a cast stored at once into an output of its dtype is redundant (the store rounds alike);
    # one read again, or stored into another dtype, stays
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.MUL, 1, 0, 0),
        Instr(Op.CAST_BF16, 2, 1),
        Instr(Op.STORE, -1, 0, 2),
        Instr(Op.CAST_F16, 0, 1),
        Instr(Op.STORE, -1, 1, 0),
        Instr(Op.CAST_BF16, 2, 1),
        Instr(Op.STORE, -1, 2, 2),
        Instr(Op.NEG, 0, 2),
        Instr(Op.STORE, -1, 3, 0),
        n_inputs=1,
        n_outputs=4,
    )
    dtypes = [torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    kept = vm.without_redundant_casts(p, dtypes)
    assert [i.op for i in kept.instrs].count(Op.CAST_BF16) == 1  # the one NEG reads
    assert [i.op for i in kept.instrs].count(Op.CAST_F16) == 0
    assert [i.b for i in kept.instrs if i.op is Op.STORE][:2] == [1, 1]
    assert vm.without_redundant_casts(p, [torch.float32] * 4) is p
    x = values(5000, seed=10, scale=30.0)
    got = vm.run(p, [x], x.shape, dtypes)
    want = run_reference(p, [x], x.shape, dtypes)
    for g, w in zip(got, want, strict=True):  # exact: the rounding is the store's
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_dropping_casts_keeps_random_programs_valid_and_their_results_exact() -> None:
    """Random programs of casts, arithmetic and stores (a store often right after a cast):
    the program without its redundant casts is a valid program, and the VM running it gives
    what the reference executor gives for the original, bit for bit."""
    import random

    rng = random.Random(0)
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    x = values(300, seed=11, scale=30.0)
    dropped = 0
    for _ in range(150):
        n_regs, n_out = rng.randint(2, 4), rng.randint(1, 3)
        body = []
        for _ in range(rng.randint(1, 10)):
            op = rng.choice([Op.CAST_BF16, Op.CAST_F16, Op.MUL, Op.NEG, Op.CAST_BF16])
            a, b = rng.randrange(n_regs), rng.randrange(n_regs)
            body.append(Instr(op, rng.randrange(n_regs), a, b if op is Op.MUL else -1))
        for k in range(n_out):
            casts = [i for i, ins in enumerate(body) if ins.op in (Op.CAST_BF16, Op.CAST_F16)]
            if casts and rng.random() < 0.7:
                i = rng.choice(casts)
                body.insert(i + 1, Instr(Op.STORE, -1, k, body[i].dst))
            else:
                body.insert(
                    rng.randint(0, len(body)), Instr(Op.STORE, -1, k, rng.randrange(n_regs))
                )
        p = Program(
            tuple(Instr(Op.LOAD, r, 0) for r in range(n_regs)) + tuple(body), 1, n_out, n_regs
        )
        out_dtypes = [rng.choice(dtypes) for _ in range(n_out)]
        kept = vm.without_redundant_casts(p, out_dtypes)
        if kept is not p:
            dropped += 1
            Program(kept.instrs, kept.n_inputs, kept.n_outputs, kept.n_regs)  # checks it
        got = vm.run(kept, [x], x.shape, out_dtypes)
        want = run_reference(p, [x], x.shape, out_dtypes)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert dropped > 20


@pytest.mark.parametrize("cols", [7, 1000, 4096, 7000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_broadcast_over_rows(cols: int, dtype: torch.dtype) -> None:
    # a weight row read at every row is widened once per thread (rows up to 4096 columns in
    # a reducing program, 7168 in others): with and without a reduction, strided, odd tiles
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(37, cols, generator=g).to(dtype)
    w = torch.randn(2 * cols, generator=g).to(dtype)[::2]  # strided
    scale = program(
        Instr(Op.LOAD, 0, 0), Instr(Op.LOAD, 1, 1), Instr(Op.MUL, 2, 0, 1),
        Instr(Op.STORE, -1, 0, 2), n_inputs=2,
    )  # fmt: skip
    check(scale, [x, w], x.shape, [dtype], exact=True)
    check(rms_norm(1e-6), [x, w], x.shape, [dtype, torch.float32], [False, True], tol=ROW_TOL)


def test_large_outputs_streamed() -> None:
    # fp32 outputs of 16 MiB and more are written with non-temporal stores: by the STOREs of a
    # program of several passes (not computed into the output first; a stored value read
    # again still comes from its register), and in place by the SiLU and GELU loops
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.SIGMOID, 1, 0),
        Instr(Op.MUL, 1, 0, 1),
        Instr(Op.STORE, -1, 0, 1),
        Instr(Op.NEG, 2, 1),
        Instr(Op.STORE, -1, 1, 2),
        n_inputs=1,
        n_outputs=2,
    )
    x = values(4 * 2**20 + 3, seed=12).reshape(-1, 4 * 2**20 + 3)
    silu, neg = check(p, [x], x.shape, [torch.float32, torch.float32])
    torch.testing.assert_close(neg, -silu, rtol=0, atol=0, equal_nan=True)
    check(p, [x[:, 1:]], (1, 4 * 2**20 + 2), [torch.float32] * 2)  # misaligned input
    one_loop = _silu_program("x, s", False, keep_sigmoid=False)
    (got,) = check(one_loop, [x], x.shape, [torch.float32])
    torch.testing.assert_close(got, silu, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(1024, 4096), (1025, 4097)], ids=str)
def test_loops_stream_a_large_output_in_place(shape) -> None:
    """The SiLU and GELU loops write a large fp32 output (16 MiB and more) with non-temporal
    stores, whole aligned vectors only (rows of 4097 start tiles off alignment, and end in
    partial vectors): bit for bit the rows computed in two halves, each too small to stream."""
    g = torch.Generator().manual_seed(19)
    x, b = torch.randn(shape, generator=g), torch.randn(shape[1], generator=g)
    bias_gelu = program(
        Instr(Op.LOAD, 0, 0), Instr(Op.LOAD, 1, 1), Instr(Op.ADD, 2, 1, 0), Instr(Op.GELU, 1, 2),
        Instr(Op.STORE, -1, 0, 1), n_inputs=2,
    )  # fmt: skip
    silu = _silu_program("x, s", False, keep_sigmoid=False)
    for prog, inputs in ((bias_gelu, [b, x]), (silu, [x])):
        (whole,) = vm.run(prog, inputs, shape, [torch.float32])
        half = shape[0] // 2
        parts = [
            vm.run(prog, [*inputs[:-1], rows], rows.shape, [torch.float32])[0]
            for rows in (x[:half], x[half:])
        ]
        torch.testing.assert_close(whole, torch.cat(parts), rtol=0, atol=0, equal_nan=True)


def test_outputs_in_a_given_layout() -> None:
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(2, 5, 3, 7, generator=g), torch.randn(2, 5, 3, 7, generator=g)
    layout = torch.empty(2, 3, 5, 7).transpose(1, 2).stride()  # (105, 7, 35, 1)
    kernel = vm.Kernel(binary(Op.MUL), [torch.bfloat16])
    (got,) = kernel([x, y], x.shape, out_strides=[layout])
    assert got.stride() == layout
    assert torch.equal(got, (x * y).bfloat16())
    (plain,) = kernel([x, y], x.shape, out_strides=[None])
    assert plain.is_contiguous()
    assert torch.equal(plain, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    ["transposed", "channels last", "mixed", "mixed, long rows", "bias over a transposed output"],
)
def test_permuted_layouts(case: str, dtype: torch.dtype) -> None:
    """Without reductions the VM walks the domain in the order of the first output's strides
    (a transposed or channels-last output, and the inputs laid out like it, along their
    contiguous dim): the same values whatever the layouts, against the reference. With rows
    of a tile or more, an input laid out across them is copied a band of rows at a time
    ("mixed, long rows": 37 rows of 1030, a partial last band, tiles across two rows, two
    threads)."""
    g = torch.Generator().manual_seed(5)
    if case == "channels last":
        shape, perm = (3, 37, 5, 19), (0, 2, 3, 1)  # stored as (3, 5, 19, 37)
    elif case == "mixed, long rows":
        shape, perm = (1030, 37), (1, 0)  # walked as 37 rows of 1030: y across them
    else:
        shape, perm = (67, 1029), (1, 0)  # stored as (1029, 67): a transpose
    inverse = [perm.index(d) for d in range(len(shape))]

    def permuted(t: torch.Tensor) -> torch.Tensor:  # t's values, laid out in `perm` order
        return t.permute(perm).contiguous().permute(inverse)

    x = torch.randn(shape, generator=g).to(dtype)
    y = torch.randn(shape, generator=g).to(dtype)
    if case == "bias over a transposed output":
        y = torch.randn(shape[-1], generator=g).to(dtype)
    px = permuted(x)
    py = y if case.startswith("mixed") or case.startswith("bias") else permuted(y)
    layout = permuted(torch.empty(shape)).stride()
    prog = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.SIGMOID, 1, 0),
        Instr(Op.MUL, 2, 0, 1),
        Instr(Op.LOAD, 3, 1),
        Instr(Op.MUL, 4, 2, 3),
        Instr(Op.EXP, 5, 3),
        Instr(Op.STORE, -1, 0, 4),
        Instr(Op.STORE, -1, 1, 5),
        n_inputs=2,
        n_outputs=2,
    )
    outs = vm.Kernel(prog, [dtype, torch.float32])([px, py], shape, out_strides=[layout, None])
    want = run_reference(prog, [x, y], shape, [dtype, torch.float32])
    assert outs[0].stride() == layout
    for got, w in zip(outs, want, strict=True):
        torch.testing.assert_close(got, w, rtol=TOL[got.dtype][0], atol=1e-6)


@pytest.mark.parametrize(
    ("strides", "reduced", "match"),
    [
        ([(7, 1)], [False], "give 3 strides"),
        ([(1, 1, 1)], [False], "not a dense, non-overlapping layout"),
        ([(70, 7, 2)], [False], "not a dense, non-overlapping layout"),
        ([(35, 7, 1)], [True], "non-reduced output"),
        ([None, None], [False], "one entry per output"),
    ],
)
def test_bad_output_layouts_raise(strides, reduced, match) -> None:
    x = torch.randn(2, 5, 7)
    kernel = vm.Kernel(unary(Op.EXP), [torch.float32], reduced)
    with pytest.raises(ValueError, match=match):
        kernel([x], x.shape, out_strides=strides)


@pytest.mark.parametrize("n", [1, 3, 1023, 1025, 1_000_003])
def test_odd_sizes(n: int) -> None:
    x = values(n, seed=n)
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.SIGMOID, 1, 0),
        Instr(Op.MUL, 1, 0, 1),
        Instr(Op.STORE, -1, 0, 1),
        n_inputs=1,
    )
    check(p, [x], (n,), [torch.float32])
    check(p, [x.reshape(1, n, 1)], (1, n, 1), [torch.bfloat16])


def softmax() -> Program:
    return program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.REDUCE_MAX, 1, 0),
        Instr(Op.SUB, 0, 0, 1),
        Instr(Op.EXP, 0, 0),
        Instr(Op.REDUCE_SUM, 1, 0),
        Instr(Op.DIV, 0, 0, 1),
        Instr(Op.STORE, -1, 0, 0),
        n_inputs=1,
    )


def rms_norm(eps: float) -> Program:
    return program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.MUL, 1, 0, 0),
        Instr(Op.REDUCE_MEAN, 1, 1),
        Instr(Op.CONST, 2, imm=eps),
        Instr(Op.ADD, 1, 1, 2),
        Instr(Op.RSQRT, 1, 1),
        Instr(Op.MUL, 0, 0, 1),
        Instr(Op.LOAD, 2, 1),
        Instr(Op.MUL, 0, 0, 2),
        Instr(Op.STORE, -1, 0, 0),
        Instr(Op.STORE, -1, 1, 1),  # the row's 1/rms, reduced
        n_inputs=2,
        n_outputs=2,
    )


def layer_norm(eps: float) -> Program:
    return program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.REDUCE_MEAN, 1, 0),
        Instr(Op.SUB, 0, 0, 1),
        Instr(Op.MUL, 2, 0, 0),
        Instr(Op.REDUCE_MEAN, 2, 2),
        Instr(Op.CONST, 3, imm=eps),
        Instr(Op.ADD, 2, 2, 3),
        Instr(Op.RSQRT, 2, 2),
        Instr(Op.MUL, 0, 0, 2),
        Instr(Op.LOAD, 3, 1),
        Instr(Op.MUL, 0, 0, 3),
        Instr(Op.LOAD, 3, 2),
        Instr(Op.ADD, 0, 0, 3),
        Instr(Op.STORE, -1, 0, 0),
        Instr(Op.STORE, -1, 1, 1),  # the row's mean, reduced
        n_inputs=3,
        n_outputs=2,
    )


ROWS = [(1, 1), (5, 1), (4, 3), (3, 2, 37), (33, 1000), (3, 5000), (2, 65536)]
ROW_TOL = {
    torch.float32: (2e-6, 1e-6),
    torch.bfloat16: (2**-7, 1e-3),
    torch.float16: (2**-10, 1e-4),
}


@pytest.mark.parametrize("shape", ROWS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_softmax_norms(shape, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    b = torch.randn(shape[-1], generator=g).to(dtype)
    rtol, atol = ROW_TOL[dtype]
    xf = x.float()

    (sm,) = vm.run(softmax(), [x], shape, [dtype])
    torch.testing.assert_close(sm, torch.softmax(xf, -1).to(dtype), rtol=rtol, atol=atol)

    y, inv = vm.run(rms_norm(1e-6), [x, w], shape, [dtype, torch.float32], [False, True])
    want_inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(inv, want_inv, rtol=2e-6, atol=0)
    torch.testing.assert_close(y, (xf * want_inv * w.float()).to(dtype), rtol=rtol, atol=atol)

    y, mean = vm.run(layer_norm(1e-5), [x, w, b], shape, [dtype, torch.float32], [False, True])
    want = torch.nn.functional.layer_norm(xf, shape[-1:], w.float(), b.float(), 1e-5)
    torch.testing.assert_close(y, want.to(dtype), rtol=rtol, atol=max(atol, 1e-5))
    torch.testing.assert_close(mean, xf.mean(-1, keepdim=True), rtol=2e-6, atol=1e-6)
    for p, ins, red in [(softmax(), [x], None), (rms_norm(1e-6), [x, w], [False, True])]:
        outs = [dtype] + [torch.float32] * (p.n_outputs - 1)
        check(p, ins, shape, outs, red, tol=ROW_TOL)


@pytest.mark.parametrize("isa", _lib.builds())
@pytest.mark.parametrize("operand", [(), (64, 1)], ids=["scalar", "row-scalar"])
def test_products_of_broadcast_values_reduced(isa: str, operand) -> None:
    """MUL of two broadcast values (a scalar, or one value per row) then REDUCE_SUM: the
    fused pass read whole rows from registers holding one value each (inf, NaN or 0 varying
    run to run, a segfault on long rows); it runs only on whole rows now."""
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.MUL, 1, 0, 0),
        Instr(Op.REDUCE_SUM, 0, 1),
        Instr(Op.STORE, -1, 0, 0),
        n_inputs=1,
        n_outputs=1,
    )
    x = torch.full(operand, 2.0)
    for domain in ((64, 256), (64, 65536)):
        kernel = vm.Kernel(p, [torch.float32], [True], isa=isa)
        (out,) = kernel([x], domain)
        assert torch.equal(out, torch.full((64, 1), 4.0 * domain[-1]))


@pytest.mark.parametrize("isa", _lib.builds())
@pytest.mark.parametrize("operand", [(), (4, 1)], ids=["scalar", "row-scalar"])
def test_sums_of_a_broadcast_negative_zero_are_positive_zero(isa: str, operand) -> None:
    """A row of -0.0s read broadcast (one value per row, or a scalar) sums to +0.0 and has a
    mean of +0.0, as torch's sums from +0.0 do (they were -0.0: the value times the row's
    length); its max stays -0.0."""
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.REDUCE_SUM, 1, 0),
        Instr(Op.REDUCE_MEAN, 2, 0),
        Instr(Op.REDUCE_MAX, 3, 0),
        Instr(Op.STORE, -1, 0, 1),
        Instr(Op.STORE, -1, 1, 2),
        Instr(Op.STORE, -1, 2, 3),
        n_inputs=1,
        n_outputs=3,
    )
    x = torch.full(operand, -0.0)
    domain = (4, 7)
    kernel = vm.Kernel(p, [torch.float32] * 3, [True] * 3, isa=isa)
    total, mean, top = kernel([x], domain)
    full = x.expand(domain)
    for got, want in [(total, full.sum(-1, keepdim=True)), (mean, full.mean(-1, keepdim=True))]:
        assert torch.equal(got.signbit(), want.signbit())
        assert not bool(got.signbit().any())
    assert bool(top.signbit().all())


@pytest.mark.parametrize("isa", _lib.builds())
@pytest.mark.parametrize("value", [3e38, -3e38, 0.1], ids=str)
def test_the_mean_of_a_broadcast_row_is_its_sum_over_its_length(isa: str, value: float) -> None:
    """The mean of a row read broadcast is its sum over its length, as for a stored row and in
    torch: a row of 3e38s has an inf mean (its sum overflows), which was 3e38."""
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.REDUCE_MEAN, 1, 0),
        Instr(Op.STORE, -1, 0, 1),
        n_inputs=1,
        n_outputs=1,
    )
    x = torch.full((4, 1), value)
    domain = (4, 5)
    (got,) = vm.Kernel(p, [torch.float32], [True], isa=isa)([x], domain)
    (stored,) = vm.Kernel(p, [torch.float32], [True], isa=isa)([x.expand(domain).clone()], domain)
    assert torch.equal(got, stored)
    assert torch.equal(got, x.expand(domain).mean(-1, keepdim=True))


@pytest.mark.parametrize("shape", [(5, 1), (33, 1000), (3, 5000)], ids=str)
def test_products_reduced_with_and_without_fusion(shape) -> None:
    # MUL then REDUCE_SUM runs as one pass when the products are not read again; read again,
    # or with a row-scalar operand, as two: all equal torch's sums (in another order)
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 1, 1),
        Instr(Op.MUL, 2, 0, 1),
        Instr(Op.REDUCE_SUM, 2, 2),  # fused (the sum overwrites the products)
        Instr(Op.MUL, 3, 0, 0),
        Instr(Op.REDUCE_MEAN, 4, 3),  # the products are read again: not fused
        Instr(Op.ADD, 3, 3, 4),
        Instr(Op.MUL, 5, 0, 4),
        Instr(Op.REDUCE_SUM, 5, 5),  # a row-scalar operand: not fused
        Instr(Op.MUL, 6, 1, 1),
        Instr(Op.REDUCE_SUM, 7, 6),  # fused (the products are not read again)
        Instr(Op.STORE, -1, 0, 2),
        Instr(Op.STORE, -1, 1, 3),
        Instr(Op.STORE, -1, 2, 5),
        Instr(Op.STORE, -1, 3, 7),
        n_inputs=2,
        n_outputs=4,
    )
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        xf = x.to(dtype).float()
        dot, sq, scaled, yy = vm.run(
            p, [x.to(dtype), y], shape, [torch.float32] * 4, [True, False, True, True]
        )
        ms = (xf * xf).mean(-1, keepdim=True)
        torch.testing.assert_close(dot, (xf * y).sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(sq, xf * xf + ms, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scaled, (xf * ms).sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(yy, (y * y).sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)


def broadcasts() -> Program:
    """Row-scalar registers (reductions, a load broadcast along the row) and scalar ones
    (CONST, a load broadcast everywhere) mixed with full ones in every operand position."""
    return program(
        Instr(Op.LOAD, 0, 0),  # full
        Instr(Op.LOAD, 1, 1),  # one value per row
        Instr(Op.LOAD, 2, 2),  # one value
        Instr(Op.CONST, 3, imm=0.5),
        Instr(Op.REDUCE_MAX, 4, 0),
        Instr(Op.SUB, 5, 0, 4),  # full - row
        Instr(Op.SUB, 6, 4, 0),  # row - full
        Instr(Op.MUL, 7, 4, 3),  # row * scalar: a row
        Instr(Op.ADD, 7, 7, 1),  # row + row
        Instr(Op.NEG, 8, 7),  # unary on a row
        Instr(Op.REDUCE_MAX, 8, 8),  # reduce a row
        Instr(Op.GT, 9, 0, 1),
        Instr(Op.WHERE, 10, 9, 4, 3),  # full condition, row / scalar values
        Instr(Op.WHERE, 11, 1, 0, 2),  # row condition
        Instr(Op.WHERE, 12, 3, 1, 0),  # scalar condition
        Instr(Op.WHERE, 13, 2, 7, 3),  # all broadcast: a row
        Instr(Op.MIN, 14, 2, 0),  # scalar, full
        Instr(Op.STORE, -1, 0, 5),
        Instr(Op.STORE, -1, 1, 6),
        Instr(Op.STORE, -1, 2, 7),  # a row into a full output: broadcast
        Instr(Op.STORE, -1, 3, 8),  # into a reduced one: once per row
        Instr(Op.STORE, -1, 4, 10),
        Instr(Op.STORE, -1, 5, 11),
        Instr(Op.STORE, -1, 6, 12),
        Instr(Op.STORE, -1, 7, 13),
        n_inputs=3,
        n_outputs=8,
    )


def broadcast_math() -> Program:
    """The rounding ops on row-scalars and scalars: pow, exp, sums and means of equal rows."""
    return program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 1, 1),
        Instr(Op.CONST, 2, imm=2.0),
        Instr(Op.REDUCE_MEAN, 3, 0),
        Instr(Op.POW, 4, 0, 2),  # full ** scalar
        Instr(Op.POW, 5, 3, 0),  # row ** full
        Instr(Op.ADD, 4, 4, 5),
        Instr(Op.EXP, 6, 3),
        Instr(Op.REDUCE_SUM, 7, 6),  # a row's sum of equal values
        Instr(Op.REDUCE_MEAN, 8, 1),
        Instr(Op.REDUCE_SUM, 9, 2),  # of a scalar
        Instr(Op.ADD, 8, 8, 9),
        Instr(Op.STORE, -1, 0, 4),
        Instr(Op.STORE, -1, 1, 7),
        Instr(Op.STORE, -1, 2, 8),
        Instr(Op.STORE, -1, 3, 9),
        n_inputs=2,
        n_outputs=4,
    )


@pytest.mark.parametrize("shape", [(5, 1), (4, 3), (3, 2, 37), (700, 5), (33, 1000), (3, 5000)],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_scalar_and_scalar_registers(shape, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x.view(-1)[::5] = 0.0
    per_row = torch.randn((*shape[:-1], 1), generator=g).to(dtype)
    per_row.view(-1)[::3] = 0.0
    one = torch.tensor(-0.25).to(dtype)
    reduced = [False, False, False, True, False, False, False, True]
    outs = [dtype, torch.float32, dtype, torch.float16, dtype, torch.bfloat16, dtype, dtype]
    got = check(broadcasts(), [x, per_row, one], shape, outs, reduced, exact=True)
    torch.testing.assert_close(got[2], torch.broadcast_to(got[7], shape).to(dtype), rtol=0, atol=0)
    outs = [torch.float32, torch.float32, dtype, torch.float32]
    math_ = check(broadcast_math(), [x.abs(), per_row], shape, outs, [False, True, True, False],
                  tol=ROW_TOL)  # fmt: skip
    assert math_[3].shape == shape  # a scalar stored broadcast
    assert bool((math_[3] == 2.0 * shape[-1]).all())


def test_constants_without_reductions() -> None:
    p = program(
        Instr(Op.CONST, 0, imm=-1.5),
        Instr(Op.LOAD, 1, 0),
        Instr(Op.WHERE, 2, 1, 0, 1),
        Instr(Op.STORE, -1, 0, 0),
        Instr(Op.STORE, -1, 1, 0),
        Instr(Op.STORE, -1, 2, 2),
        n_inputs=1,
        n_outputs=3,
    )
    x = values(3000, seed=4).reshape(3, 1000)
    got = check(p, [x], x.shape, [torch.bfloat16, torch.float32, torch.float32],
                [False, True, False], exact=True)  # fmt: skip
    assert bool((got[0] == -1.5).all())
    assert got[1].shape == (3, 1)


def test_reduce_special_values_and_max_nan() -> None:
    x = torch.tensor([[1.0, math.nan, 3.0], [math.inf, -math.inf, 0.0], [-5.0, -1.0, -2.0]])
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.REDUCE_MAX, 1, 0),
        Instr(Op.REDUCE_SUM, 2, 0),
        Instr(Op.REDUCE_MEAN, 3, 0),
        Instr(Op.STORE, -1, 0, 1),
        Instr(Op.STORE, -1, 1, 2),
        Instr(Op.STORE, -1, 2, 3),
        n_inputs=1,
        n_outputs=3,
    )
    mx, sm, mn = check(p, [x], x.shape, [torch.float32] * 3, [True] * 3, exact=True)
    assert mx.flatten().tolist()[1:] == [math.inf, -1.0]
    assert math.isnan(mx[0, 0])
    assert math.isnan(sm[1, 0])
    assert mn[2, 0] == pytest.approx(-8 / 3)


def test_reduced_output_without_reductions_takes_the_rows_first_value() -> None:
    x = torch.randn(6, 2, 2000)
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.EXP, 1, 0),
        Instr(Op.STORE, -1, 0, 1),
        Instr(Op.STORE, -1, 1, 0),
        n_inputs=1,
        n_outputs=2,
    )
    _, first = check(p, [x], x.shape, [torch.float32, torch.float16], [False, True])
    assert first.shape == (6, 2, 1)
    assert torch.equal(first, x[..., :1].half())


def test_threads_do_not_change_results() -> None:
    x = torch.randn(300, 3000)
    w = torch.randn(3000)
    for p, ins, outs, red in [
        (rms_norm(1e-6), [x, w], [torch.float32, torch.float32], [False, True]),
        (binary(Op.POW), [x.abs(), w], [torch.bfloat16], None),
        (unary(Op.SIN), [x * 100], [torch.float32], None),
    ]:
        one = vm.run(p, ins, x.shape, outs, red, threads=1)
        for threads in (2, 3, 10**12):  # more threads than cores: the VM caps the team
            more = vm.run(p, ins, x.shape, outs, red, threads=threads)
            for a, b in zip(one, more, strict=True):
                assert torch.equal(a, b)


def test_outputs_are_cpu_tensors_whatever_the_default_device() -> None:
    """Under another default device the outputs came from there: a meta one gave the VM null
    pointers (refused), a CUDA one would have handed it device memory."""
    x = torch.randn(3, 7)
    (want,) = vm.run(softmax(), [x], x.shape, [torch.float32])
    launch = vm.Kernel(softmax(), [torch.float32]).bind(x.shape, [x], [(0, x.shape)], [x.shape])
    with torch.device("meta"):
        (got,) = vm.run(softmax(), [x], x.shape, [torch.float32])
        (bound,) = launch([x])
    assert got.device.type == bound.device.type == "cpu"
    assert torch.equal(got, want)
    assert torch.equal(bound, want)


def test_zero_size_domain() -> None:
    x = torch.randn(0, 5)
    (y,) = vm.run(softmax(), [x], (0, 5), [torch.float32])
    assert y.shape == (0, 5)


@pytest.mark.parametrize("isa", _lib.builds())
def test_every_isa_build(isa: str) -> None:
    """Each build this CPU runs (base = SSE2 code without F16C) against the reference."""
    x = values(3000, seed=9)
    y = values(3000, seed=10)[torch.randperm(3000)]
    for op in sorted(UNARY):
        for dtype in DTYPES:
            k = vm.Kernel(unary(op), [dtype], isa=isa)
            (got,) = k([x.to(dtype)], x.shape)
            (want,) = run_reference(unary(op), [x.to(dtype)], x.shape, [dtype])
            rtol, atol = (0, 0) if op in EXACT else unary_tol(op)[dtype]
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    for op in sorted(BINARY):
        (got,) = vm.Kernel(binary(op), [torch.float32], isa=isa)([x, y], x.shape)
        (want,) = run_reference(binary(op), [x, y], x.shape, [torch.float32])
        rtol, atol = (0, 0) if op in EXACT else TOL[torch.float32]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    (got,) = vm.Kernel(softmax(), [torch.bfloat16], isa=isa)([x.reshape(3, 1000)], (3, 1000))
    want = torch.softmax(x.reshape(3, 1000).nan_to_num(), -1)
    assert torch.equal(got.isnan().any(-1), x.reshape(3, 1000).isnan().any(-1))
    ok = ~x.reshape(3, 1000).isnan().any(-1)
    torch.testing.assert_close(got[ok], want[ok].bfloat16(), rtol=2**-7, atol=1e-3)
    assert "base" in _lib.builds()


@pytest.mark.parametrize("isa", _lib.builds())
def test_every_isa_build_keeps_the_sign_of_a_zero_result(isa: str) -> None:
    """A zero result has the reference's sign (log1p(-0) and sin(-0) are -0; both gave +0):
    1 / y is -inf or inf by it. Vector body and scalar tail."""
    x = torch.tensor([-0.0, 0.0, -1e-30, 1e-30] * 9)
    for op in sorted(UNARY):
        for dtype in DTYPES:
            (got,) = vm.Kernel(unary(op), [dtype], isa=isa)([x.to(dtype)], x.shape)
            (want,) = run_reference(unary(op), [x.to(dtype)], x.shape, [dtype])
            zero = want == 0
            assert torch.equal(got[zero].signbit(), want[zero].signbit()), (op.name, dtype)


@pytest.mark.parametrize("wanted", ["avx2", "V3", "v5"])
def test_a_dvm_isa_this_machine_cannot_run_is_an_error(monkeypatch, wanted: str) -> None:
    """A misspelt or unusable DVM_ISA used to switch every compile to the Python reference
    executor (5-15x slower) without a word."""
    from dvm import compile as dvm_compile

    monkeypatch.setenv("DVM_ISA", wanted)
    _lib.library.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"DVM_ISA='{wanted}' is not a dvm build.*base"):
            dvm_compile._select_executor()
    finally:
        monkeypatch.delenv("DVM_ISA")
        _lib.library.cache_clear()
    assert dvm_compile._select_executor()[1] == "vm"


@pytest.mark.parametrize("isa", _lib.builds())
def test_gelu_accuracy_and_special_values_on_every_build(isa: str) -> None:
    """GELU within |x| 2.5e-7 (erf's bound times |x| / 2) plus an ulp of the float64 value on
    each build: the AVX-512 build's table form (vmath.h's gelu16) and the portable erf form,
    over random fp32 bit patterns and a dense grid, a run ending in a partial vector. Zero keeps
    its sign, x <= -6 gives -0, and inf, -inf, NaN give inf, NaN, NaN (torch's float64 GELU)."""
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31, (100_000,), generator=g, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(torch.float32), torch.linspace(-8, 8, 100_003)])
    kernel = vm.Kernel(unary(Op.GELU), [torch.float32], isa=isa)
    got = kernel([x], x.shape)[0].double()
    want = torch.nn.functional.gelu(x.double())
    bound = x.double().abs() * 2.5e-7 + want.abs() * 2**-23 + 2**-149
    finite = torch.isfinite(want)
    assert ((got - want).abs() <= bound)[finite].all()
    assert torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num())
    special = torch.tensor([0.0, -0.0, -6.0, -10.0, -3e38, math.inf, -math.inf, math.nan])
    got = kernel([special], special.shape)[0]
    assert got[:5].tolist() == [0.0] * 5
    assert torch.signbit(got[:5]).tolist() == [False, True, True, True, True]
    assert got[5] == math.inf
    assert got[6:].isnan().all()


def test_gelu_table_is_the_fit_tools() -> None:
    """vmath.h's GELU_TABLE is what tools/fit_gelu.py fits (to the last digits a least squares
    solver may move), and the tool's float32 evaluation of it keeps H within 3.6e-8."""
    root = pathlib.Path(__file__).parents[1]
    spec = importlib.util.spec_from_file_location("fit_gelu", root / "tools" / "fit_gelu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    source = (root / "csrc" / "vmath.h").read_text()
    body = source[source.index("GELU_TABLE[5][32] = {") :].split("};")[0]
    values = re.findall(r"(-?[0-9.]+(?:e-?[0-9]+)?)f", body)  # the literals with an f
    table = torch.tensor([float(v) for v in values]).reshape(5, 32)
    torch.testing.assert_close(table, tool.fit(), rtol=1e-4, atol=1e-12)
    x = torch.linspace(0.0, 8.0, 400_001)
    assert (tool.evaluate(table, x).double() - tool.half_erf(x)).abs().max() <= 3.6e-8


@pytest.mark.skipif(
    not {"v4", "v3"} <= set(_lib.builds()), reason="needs an AVX-512 CPU (the v4 and v3 builds)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_sigmoid_and_silu_equal_the_portable_code(dtype: torch.dtype) -> None:
    """The v4 build's hand-vectorised sigmoid/SiLU (vmath.h's sigmoid16) gives the bits of the
    portable sigmoid_f as the v3 build (FMA too) compiles it, over random fp32 bit patterns and
    run lengths that end in a partial vector; a NaN stays a NaN (its sign may differ)."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64)
    x = torch.cat([torch.tensor(SPECIALS), bits.to(torch.int32).view(torch.float32)]).to(dtype)
    silu = _silu_program("x, s", out_dtype_read_later=False, keep_sigmoid=False)
    for prog in (unary(Op.SIGMOID), silu):
        for n in (x.numel(), 1000 * 7 + 3):
            xs = x[:n]
            (got,) = vm.Kernel(prog, [dtype], isa="v4")([xs], xs.shape)
            (want,) = vm.Kernel(prog, [dtype], isa="v3")([xs], xs.shape)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan)
            assert torch.equal(got[~nan], want[~nan])


@pytest.mark.skipif(
    shutil.which("objdump") is None or platform.machine() not in {"x86_64", "AMD64"},
    reason="reads the x86-64 builds' code with binutils' objdump",
)
@pytest.mark.parametrize("isa", _lib.builds())
def test_builds_keep_their_prefetches(isa: str) -> None:
    """GCC's vectoriser drops __builtin_prefetch from loops it vectorises, which once left
    every build without its input prefetches: a bf16 SiLU at 8192x4096 ran at half speed.
    Each build must still hold prefetch instructions (prefetch_ahead in ops.h)."""
    code = subprocess.run(
        ["objdump", "-d", _lib._built(isa)], capture_output=True, text=True, check=True
    ).stdout
    assert "prefetcht0" in code


def ulp_error(got: torch.Tensor, want64: torch.Tensor) -> float:
    want = want64.float()
    finite = torch.isfinite(want)
    spacing = (torch.nextafter(want.abs(), torch.tensor(math.inf)) - want.abs()).double()
    assert torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num())  # inf, NaN agree
    return ((got.double() - want64).abs() / spacing)[finite].max().item()


def test_math_accuracy() -> None:
    """The bounds vmath.h states, against float64 torch rounded to fp32."""
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31, (100_000,), generator=g, dtype=torch.int64)
    wide = bits.to(torch.int32).view(torch.float32)
    wide = torch.cat(
        [wide[torch.isfinite(wide)], torch.tensor(SPECIALS), torch.randn(50_000, generator=g) * 8]
    )
    bounds = {
        Op.SQRT: 0.5,
        Op.EXP: 1,
        Op.LOG: 1,
        Op.LOG1P: 2,
        Op.SIGMOID: 3,
        Op.TANH: 3,
        Op.RSQRT: 1.5,
    }
    torch_fns = {Op.SQRT: torch.sqrt, Op.EXP: torch.exp, Op.LOG: torch.log, Op.LOG1P: torch.log1p,
                 Op.SIGMOID: torch.sigmoid, Op.TANH: torch.tanh, Op.RSQRT: torch.rsqrt,
                 Op.SIN: torch.sin, Op.COS: torch.cos}  # fmt: skip
    for op, bound in bounds.items():
        got = vm.run(unary(op), [wide], wide.shape, [torch.float32])[0]
        assert ulp_error(got, torch_fns[op](wide.double())) <= bound, op.name
    moderate = wide[wide.abs() <= 1e6]
    for op in (Op.SIN, Op.COS):
        got = vm.run(unary(op), [moderate], moderate.shape, [torch.float32])[0]
        assert ulp_error(got, torch_fns[op](moderate.double())) <= 1, op.name
        big = torch.tensor([1e7, -3e9, 1e30, 3e38, math.inf])  # the C library's path
        got = vm.run(unary(op), [big], big.shape, [torch.float32])[0]
        torch.testing.assert_close(got, torch_fns[op](big), rtol=1e-6, atol=1e-7, equal_nan=True)
    got = vm.run(unary(Op.ERF), [wide], wide.shape, [torch.float32])[0]
    assert (got.double() - torch.erf(wide.double())).abs().nan_to_num().max() <= 5e-7
    assert torch.equal(got.isnan(), wide.isnan())
    a, b = wide.abs()[: len(wide) // 2] % 100, (torch.randn(len(wide) // 2, generator=g) * 10)
    got = vm.run(binary(Op.POW), [a, b], a.shape, [torch.float32])[0]
    want = torch.pow(a.double(), b.double())
    ok = (want.float() != 0) & torch.isfinite(want.float())
    assert ulp_error(got[ok], want[ok]) <= 1


def test_16bit_stores_round_to_nearest_even() -> None:
    bits = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        exact = bits.view(dtype).float()  # every 16-bit value, widened
        mid = torch.nextafter(exact, torch.tensor(math.inf))  # and just above each
        x = torch.cat([exact, mid, exact * 1.0000001, exact * (1 + 2**-9)])
        (got,) = vm.run(unary(Op.ABS), [x], x.shape, [dtype])
        want = x.abs().to(dtype)
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))
        assert torch.equal(vm.run(unary(Op.ABS), [x.to(dtype)], x.shape, [torch.float32])[0]
                           .nan_to_num(), x.to(dtype).float().abs().nan_to_num())  # fmt: skip


# --- bad input: Python exceptions, and statuses (never crashes) from the C ABI itself


def test_programs_written_with_int_opcodes_or_plain_tuples_run() -> None:
    """A user's program need not spell Op members: before, int opcodes failed in the program's
    own check with an AttributeError (an int has no .name)."""
    x = torch.randn(3, 5)
    prog = Program((Instr(0, 0, 0), (10, 1, 0), Instr(2, -1, 0, 1)), 1, 1, 2)
    assert [ins.op for ins in prog.instrs] == [Op.LOAD, Op.NEG, Op.STORE]
    assert prog.disassemble() == "r0 = load in0\nr1 = neg r0\nout0 = store r1"
    assert torch.equal(vm.run(prog, [x], x.shape, [torch.float32])[0], -x)


@pytest.mark.parametrize(
    ("instrs", "n_regs", "match"),
    [
        ((Instr(99, 0, 0),), 1, "instruction 0 is Instr"),
        (("load",), 1, "instruction 0 is 'load'"),
        ((Instr(Op.LOAD, 0, 0), 7), 1, "instruction 1 is 7"),
        ((Instr(Op.NEG, 0, 1),), 2, r"reads r1 before it is written"),
        ((Instr(Op.LOAD, 3, 0),), 2, "writes outside r0..r1"),
        ((Instr(Op.LOAD, 0, 4),), 1, "loads a missing input"),
    ],
)
def test_invalid_programs_are_clear_errors(instrs, n_regs, match) -> None:
    with pytest.raises(ValueError, match=f"invalid dvm program: .*{match}"):
        Program((*instrs, Instr(Op.STORE, -1, 0, 0)), 1, 1, n_regs)


def test_bad_arguments_raise_clear_errors() -> None:
    p = binary(Op.ADD)
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="takes 2 inputs"):
        vm.run(p, [x], x.shape, [torch.float32])
    with pytest.raises(TypeError, match="float64"):
        vm.run(p, [x, x.double()], x.shape, [torch.float32])
    with pytest.raises(TypeError, match=r"output 0 has dtype torch\.int32; the VM takes"):
        vm.run(p, [x, x], x.shape, [torch.int32])
    with pytest.raises(ValueError, match="does not broadcast"):
        vm.run(p, [x, torch.randn(3)], x.shape, [torch.float32])
    with pytest.raises(ValueError, match="more than the domain"):
        vm.run(p, [x, torch.randn(1, 4, 5)], x.shape, [torch.float32])
    with pytest.raises(ValueError, match="meta"):
        vm.run(p, [x, torch.empty(4, 5, device="meta")], x.shape, [torch.float32])
    with pytest.raises(TypeError, match=r"not a torch\.Tensor"):
        vm.run(p, [x, 1.0], x.shape, [torch.float32])
    with pytest.raises(ValueError, match="non-negative"):
        vm.run(p, [x, x], (4, -5), [torch.float32])
    with pytest.raises(ValueError, match="1 to 6"):
        vm.run(p, [x, x], (1,) * 7, [torch.float32])
    with pytest.raises(TypeError, match="sequence of ints"):
        vm.run(p, [x, x], "ab", [torch.float32])
    with pytest.raises(TypeError, match="sequence of ints"):  # it ran as (4, 5) before
        vm.run(p, [x, x], (4, 5.5), [torch.float32])
    with pytest.raises(ValueError, match="give 1 out_dtypes"):
        vm.run(p, [x, x], x.shape, [torch.float32, torch.float32])
    with pytest.raises(ValueError, match="threads"):
        vm.run(p, [x, x], x.shape, [torch.float32], threads=0)
    with pytest.raises(TypeError, match="Program"):
        vm.Kernel("r0 = load in0", [torch.float32])  # type: ignore[arg-type]
    with pytest.raises(vm.VMError, match="at most 65536"):
        vm.run(softmax(), [torch.zeros(1, 65537)], (1, 65537), [torch.float32])
    row_sum = program(
        Instr(Op.LOAD, 0, 0), Instr(Op.REDUCE_SUM, 1, 0), Instr(Op.STORE, -1, 0, 1), n_inputs=1
    )
    with pytest.raises(vm.VMError, match="rows of 0 elements"):  # the sums were never written
        vm.run(row_sum, [torch.zeros(3, 0)], (3, 0), [torch.float32], [True])
    (empty,) = vm.run(softmax(), [torch.zeros(3, 0)], (3, 0), [torch.float32])
    assert empty.shape == (3, 0)
    negated = torch.randn(4, 5, dtype=torch.complex64).conj().imag  # memory holds -values
    with pytest.raises(ValueError, match=r"input 1 is a lazily negated view .*resolve_neg"):
        vm.run(p, [x, negated], x.shape, [torch.float32])
    (got,) = vm.run(p, [x, negated.resolve_neg()], x.shape, [torch.float32])
    torch.testing.assert_close(got, x + negated)


def raw_call(code, n_regs=2, n_inputs=1, n_outputs=1, domain=(4, 5), in_dtype=0, out_dtype=0,
             out_strides=(5, 1), in_ptr=True, imm=True):  # fmt: skip
    lib, _ = _lib.library()
    x, y = torch.randn(4, 5), torch.empty(4, 5)
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    n = len(code) // 5
    nd = len(domain)
    return lib.dvm_run(
        (i32 * len(code))(*code),
        (ctypes.c_float * max(n, 1))() if imm else None,
        n,
        n_regs,
        n_inputs,
        (ptr * 1)(x.data_ptr() if in_ptr else 0),
        (i32 * 1)(in_dtype),
        (i64 * max(nd, 1))(*([5, 1] if nd == 2 else [0] * max(nd, 1))),
        n_outputs,
        (ptr * 1)(y.data_ptr()),
        (i32 * 1)(out_dtype),
        (i64 * max(nd, 1))(*(out_strides if nd == 2 else [0] * max(nd, 1))),
        (i64 * max(nd, 1))(*domain or [0]),
        nd,
        2,
    )


def test_c_abi_validates_instead_of_crashing() -> None:
    ok = [0, 0, 0, -1, -1, 2, -1, 0, 0, -1]  # r0 = load in0; out0 = store r0
    assert raw_call(ok) == 0
    bad_programs = {
        "unknown opcode": [0, 0, 0, -1, -1, 99, 1, 0, -1, -1, 2, -1, 0, 0, -1],
        "register past n_regs": [0, 5, 0, -1, -1, 2, -1, 0, 5, -1],
        "read before write": [0, 0, 0, -1, -1, 12, 1, 1, -1, -1, 2, -1, 0, 1, -1],
        "missing input": [0, 0, 3, -1, -1, 2, -1, 0, 0, -1],
        "no store": [0, 0, 0, -1, -1],
        "stored twice": [0, 0, 0, -1, -1, 2, -1, 0, 0, -1, 2, -1, 0, 0, -1],
        "missing output": [0, 0, 0, -1, -1, 2, -1, 1, 0, -1],
        "negative register": [0, -1, 0, -1, -1, 2, -1, 0, 0, -1],
        "empty": [],
    }
    for what, code in bad_programs.items():
        assert raw_call(code) == 1, what
    assert raw_call(ok, n_regs=33) == 1
    assert raw_call(ok, n_inputs=17) == 1
    assert raw_call(ok, domain=()) == 2
    assert raw_call(ok, domain=(1,) * 7) == 2
    assert raw_call(ok, domain=(4, -5)) == 2
    assert raw_call(ok, imm=False) == 2
    assert raw_call(ok, in_ptr=False) == 2
    assert raw_call(ok, out_strides=(0, 1)) == 2  # outputs repeat only along the row
    assert raw_call(ok, in_dtype=7) == 3
    assert raw_call(ok, out_dtype=-1) == 3
    red = [0, 0, 0, -1, -1, 70, 1, 0, -1, -1, 2, -1, 0, 1, -1]
    assert raw_call(red, domain=(1, 1 << 17)) == 4


def _silu_program(order: str, out_dtype_read_later: bool, keep_sigmoid: bool) -> Program:
    """x * sigmoid(x) stored as out0 (the MUL's operands in ``order``); ``keep_sigmoid``
    also stores the sigmoid (so it is read again: no fusion), ``out_dtype_read_later`` reads
    the product again (out1 = product + product)."""
    mul = Instr(Op.MUL, 2, 0, 1) if order == "x, s" else Instr(Op.MUL, 2, 1, 0)
    instrs = [Instr(Op.LOAD, 0, 0), Instr(Op.SIGMOID, 1, 0), mul, Instr(Op.STORE, -1, 0, 2)]
    outputs = 1
    if out_dtype_read_later:
        instrs += [Instr(Op.ADD, 3, 2, 2), Instr(Op.STORE, -1, outputs, 3)]
        outputs += 1
    if keep_sigmoid:
        instrs.append(Instr(Op.STORE, -1, outputs, 1))
        outputs += 1
    return program(*instrs, n_inputs=1, n_outputs=outputs)


@pytest.mark.parametrize("shape", [(7, 5), (3, 2049), (1, 1), (9, 1)], ids=str)
@pytest.mark.parametrize("order", ["x, s", "s, x"])
@pytest.mark.parametrize("read_later", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_times_its_operand_fused_equals_two_passes(shape, order, read_later, dtype):
    """SIGMOID then MUL by the sigmoid's own operand runs as one pass (SiLU), straight into a
    bf16 output when the product is only stored: bit for bit what the two instructions give
    when the sigmoid is read again (then they run apart), and the reference within TOL."""
    x = values(shape[0] * shape[1], seed=11).reshape(shape).to(dtype)
    fused = _silu_program(order, read_later, keep_sigmoid=False)
    apart = _silu_program(order, read_later, keep_sigmoid=True)
    outs = [dtype] * fused.n_outputs
    got = check(fused, [x], shape, outs)
    twin = vm.run(apart, [x], shape, [*outs, dtype])
    for g, w in zip(got, twin, strict=False):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("after", [Op.EXP, Op.TANH, Op.ERF, Op.GELU], ids=lambda op: op.name)
@pytest.mark.parametrize("op", [Op.ADD, Op.SUB, Op.MUL, Op.DIV], ids=lambda op: op.name)
@pytest.mark.parametrize("other", ["full", "row", "scalar", "row max"])
def test_binary_then_unary_fused_equals_two_passes(op: Op, after: Op, other: str) -> None:
    """A binary op whose result only a costly unary op reads runs both in one loop (exp of
    x - max in a softmax, GELU of x + bias): bit for bit the two instructions when the binary
    result is stored too (then they run apart), and the reference within tolerance; the other
    operand full, a row broadcast down the rows, a scalar, or a row maximum (row-scalar)."""
    x = values(6 * 301, seed=21, scale=1.5).reshape(6, 301)
    y = {
        "full": values(6 * 301, seed=22, scale=1.5).reshape(6, 301) + 0.25,
        "row": values(301, seed=23, scale=1.5) + 0.25,
        "scalar": torch.tensor(0.75),
    }.get(other)
    if other == "row max":
        first = [Instr(Op.LOAD, 0, 0), Instr(Op.REDUCE_MAX, 1, 0)]
        inputs = [x]
    else:
        first = [Instr(Op.LOAD, 0, 0), Instr(Op.LOAD, 1, 1)]
        inputs = [x, y]
    body = [*first, Instr(op, 2, 0, 1), Instr(after, 3, 2), Instr(Op.STORE, -1, 0, 3)]
    fused = program(*body, n_inputs=len(inputs))
    apart = program(*body, Instr(Op.STORE, -1, 1, 2), n_inputs=len(inputs), n_outputs=2)
    (got,) = check(fused, inputs, x.shape, [torch.float32], tol=unary_tol(after))
    twin, _ = vm.run(apart, inputs, x.shape, [torch.float32] * 2)
    torch.testing.assert_close(got, twin, rtol=0, atol=0, equal_nan=True)


def test_silu_fusion_with_a_broadcast_operand_and_a_strided_bf16_output() -> None:
    """The fused pass over a row-broadcast operand (one value per row), and into an output
    whose layout the tile cannot write directly (the stores run apart), equals the reference."""
    x = values(40, seed=12).reshape(8, 5)
    col = x[:, :1].contiguous()
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 3, 1),
        Instr(Op.SIGMOID, 1, 3),
        Instr(Op.MUL, 2, 3, 1),  # x * sigmoid(x) of the broadcast column
        Instr(Op.ADD, 4, 0, 2),
        Instr(Op.STORE, -1, 0, 4),
        n_inputs=2,
    )
    check(p, [x, col], (8, 5), [torch.float32])
    q = _silu_program("x, s", False, keep_sigmoid=False)
    xt = values(64, seed=13).reshape(8, 8).to(torch.bfloat16)
    kernel = vm.Kernel(q, [torch.bfloat16])
    (out,) = kernel([xt], (8, 8), out_strides=[(1, 8)])
    assert out.stride() == (1, 8)
    (want,) = run_reference(q, [xt], (8, 8), [torch.bfloat16])
    torch.testing.assert_close(out, want, rtol=TOL[torch.bfloat16][0], atol=1e-7, equal_nan=True)


def test_sigmoid_in_place_then_squared_is_not_fused() -> None:
    """r0 = sigmoid r0; r1 = r0 * r0 is sigmoid(x)^2, not x * sigmoid(x)."""
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.SIGMOID, 0, 0),
        Instr(Op.MUL, 1, 0, 0),
        Instr(Op.STORE, -1, 0, 1),
        n_inputs=1,
    )
    x = values(300, seed=14)
    (got,) = check(p, [x], x.shape, [torch.float32])
    torch.testing.assert_close(got, torch.sigmoid(x) ** 2, rtol=1e-6, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("shape", [(4, 1024), (3, 2049), (7, 5)], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_silu_reads_a_bf16_input_in_place_when_it_is_loaded_for_nothing_else(shape, out_dtype):
    """A bf16 input loaded only for a SiLU is read by the fused loop itself: the result is
    bit for bit the one where the loaded value is stored too (the load then runs apart)."""
    x = values(shape[0] * shape[1], seed=15).reshape(shape).to(torch.bfloat16)
    core = [Instr(Op.LOAD, 0, 0), Instr(Op.SIGMOID, 1, 0), Instr(Op.MUL, 2, 0, 1)]
    alone = program(*core, Instr(Op.STORE, -1, 0, 2), n_inputs=1)
    kept = program(
        *core, Instr(Op.STORE, -1, 0, 2), Instr(Op.STORE, -1, 1, 0), n_inputs=1, n_outputs=2
    )
    got = check(alone, [x], shape, [out_dtype])
    twin, loaded = vm.run(kept, [x], shape, [out_dtype, torch.bfloat16])
    torch.testing.assert_close(got[0], twin, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(loaded, x, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(4, 1024), (3, 2049), (7, 5)], ids=str)
@pytest.mark.parametrize("op", [Op.SUB, Op.DIV, Op.MUL])
@pytest.mark.parametrize("input_first", [True, False])
@pytest.mark.parametrize("other_full", [True, False])
def test_binary_reads_a_bf16_input_in_place_into_a_bf16_output(shape, op, input_first, other_full):
    """A bf16 input loaded only as one operand of a binary op stored straight into a bf16
    output is read by that op's loop: bit for bit the result where the input is stored too
    (the load then runs apart), in either operand order, with a full or a per-row other
    operand (the latter runs apart)."""
    g = torch.Generator().manual_seed(16)
    x = torch.randn(shape, generator=g).bfloat16()
    y = (torch.randn(shape if other_full else (shape[0], 1), generator=g) + 3).bfloat16()
    pair = (0, 1) if input_first else (1, 0)
    core = [Instr(Op.LOAD, 1, 1), Instr(Op.EXP, 1, 1), Instr(Op.LOAD, 0, 0), Instr(op, 2, *pair)]
    alone = program(*core, Instr(Op.STORE, -1, 0, 2), n_inputs=2)
    kept = program(
        *core, Instr(Op.STORE, -1, 0, 2), Instr(Op.STORE, -1, 1, 0), n_inputs=2, n_outputs=2
    )
    (got,) = check(alone, [x, y], shape, [torch.bfloat16])
    twin, loaded = vm.run(kept, [x, y], shape, [torch.bfloat16] * 2)
    torch.testing.assert_close(got, twin, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(loaded, x, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(4, 1024), (3, 2049), (7, 5)], ids=str)
@pytest.mark.parametrize("op", [Op.ADD, Op.SUB, Op.DIV], ids=lambda op: op.name)
@pytest.mark.parametrize("input_first", [True, False])
@pytest.mark.parametrize("other", ["full", "row", "scalar"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_bf16_input_read_in_place_by_a_binary_then_gelu_loop(
    shape, op, input_first, other, out_dtype
):
    """A bf16 input loaded only as one operand of a binary op whose result only a GELU reads
    (GELU of x + bias) is read in place by their one loop on the AVX-512 build, which writes
    the output (bf16 rounded, or fp32): bit for bit the result where the input is stored too
    (the load then runs apart), in either operand order, with a full, row-broadcast or scalar
    other operand; and the reference within tolerance."""
    after = Op.GELU
    g = torch.Generator().manual_seed(17)
    x = torch.randn(shape, generator=g).bfloat16()
    y = {"full": torch.randn(shape, generator=g), "row": torch.randn(shape[-1], generator=g)}
    y = (y.get(other, torch.tensor(0.75)) + 3).bfloat16()
    pair = (0, 1) if input_first else (1, 0)
    core = [Instr(Op.LOAD, 1, 1), Instr(Op.LOAD, 0, 0), Instr(op, 2, *pair), Instr(after, 3, 2)]
    alone = program(*core, Instr(Op.STORE, -1, 0, 3), n_inputs=2)
    kept = program(
        *core, Instr(Op.STORE, -1, 0, 3), Instr(Op.STORE, -1, 1, 0), n_inputs=2, n_outputs=2
    )
    (got,) = check(alone, [x, y], shape, [out_dtype], tol=unary_tol(after))
    twin, loaded = vm.run(kept, [x, y], shape, [out_dtype, torch.bfloat16])
    torch.testing.assert_close(got, twin, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(loaded, x, rtol=0, atol=0)


def _silu_mul_program(order: str, keep: str) -> Program:
    """x * sigmoid(x) * y stored as out0, the last MUL's operands in ``order``; ``keep`` stores
    one more register as out1, so that it is read again and the three do not fuse: ``silu``
    (the SiLU product), ``y`` (the loaded y) or ``out`` (the final product)."""
    last = Instr(Op.MUL, 0, 2, 1) if order == "silu, y" else Instr(Op.MUL, 0, 1, 2)
    instrs = [
        Instr(Op.LOAD, 0, 0),
        Instr(Op.SIGMOID, 1, 0),
        Instr(Op.MUL, 2, 0, 1),
        Instr(Op.LOAD, 1, 1),
        last,
        Instr(Op.STORE, -1, 0, 0),
    ]
    if keep:
        instrs.append(Instr(Op.STORE, -1, 1, {"silu": 2, "y": 1, "out": 0}[keep]))
    return program(*instrs, n_inputs=2, n_outputs=2 if keep else 1)


@pytest.mark.parametrize("shape", [(4, 1024), (3, 2049), (7, 5), (1, 1)], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["silu, y", "y, silu"])
def test_silu_times_a_loaded_input_is_one_loop(shape, x_dtype, y_dtype, out_dtype, order):
    """x * sigmoid(x) * y with the SiLU product and y read by nothing else runs as one loop
    (x and y read in place, the product written into the output): bit for bit the result of
    the instructions run apart (the SiLU product stored too), and the reference within TOL."""
    g = torch.Generator().manual_seed(17)
    x = (torch.randn(shape, generator=g) * 4).to(x_dtype)
    y = torch.randn(shape, generator=g).to(y_dtype)
    (got,) = check(_silu_mul_program(order, ""), [x, y], shape, [out_dtype])
    apart, _ = vm.run(_silu_mul_program(order, "silu"), [x, y], shape, [out_dtype, out_dtype])
    torch.testing.assert_close(got, apart, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("keep", ["y", "out"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_silu_times_a_loaded_input_read_again_keeps_its_registers(keep, out_dtype) -> None:
    """When y or the final product is read again, their registers still hold them."""
    g = torch.Generator().manual_seed(18)
    x, y = torch.randn(2, 5, 300, generator=g).bfloat16()
    check(_silu_mul_program("silu, y", keep), [x, y], (5, 300), [out_dtype, torch.float32])


def test_silu_times_a_broadcast_or_strided_input() -> None:
    """y broadcast along the row (one value per row: the loop is not taken), a weight row
    shared by every row, and a transposed y (loaded into its register first)."""
    g = torch.Generator().manual_seed(19)
    x = torch.randn(6, 40, generator=g)
    p = _silu_mul_program("y, silu", "")
    for y in (torch.randn(6, 1, generator=g), torch.randn(40, generator=g)):
        check(p, [x, y], (6, 40), [torch.float32])
    yt = torch.randn(40, 6, generator=g).t()
    check(p, [x, yt], (6, 40), [torch.bfloat16])


def _scale_mul_program(order: str, cast: str, keep: str, scalar: bool = False) -> Program:
    """A norm's tail: x * s (s = rsqrt(mean(x * x)) per row, or the scalar 0.5), rounded to
    bf16 when ``cast`` (``new``: into a new register, ``same``: in place), times a loaded w,
    stored as out0. ``order`` puts the full operand first or last in both MULs; ``keep``
    stores one more register as out1 so that it is read again: ``c`` (what w multiplies),
    ``w`` or ``out``."""
    pair = (
        (lambda full, other: (full, other))
        if order == "full first"
        else (lambda full, other: (other, full))
    )
    s_instrs = (
        [Instr(Op.CONST, 1, imm=0.5)]
        if scalar
        else [Instr(Op.MUL, 1, 0, 0), Instr(Op.REDUCE_MEAN, 2, 1), Instr(Op.RSQRT, 1, 2)]
    )
    c = {"new": 4, "same": 3, "": 3}[cast]
    instrs = [Instr(Op.LOAD, 0, 0), *s_instrs, Instr(Op.MUL, 3, *pair(0, 1))]
    if cast:
        instrs.append(Instr(Op.CAST_BF16, c, 3))
    instrs += [
        Instr(Op.LOAD, 5, 1),
        Instr(Op.MUL, 6, *pair(5, c)),
        Instr(Op.STORE, -1, 0, 6),
    ]
    if keep:
        instrs.append(Instr(Op.STORE, -1, 1, {"c": c, "w": 5, "out": 6}[keep]))
    return program(*instrs, n_inputs=2, n_outputs=2 if keep else 1)


@pytest.mark.parametrize("shape", [(4, 1024), (3, 2049), (7, 5), (1, 1)], ids=str)
@pytest.mark.parametrize("w_kind", ["row fp32", "row bf16", "full bf16", "full fp16"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["full first", "full last"])
@pytest.mark.parametrize("cast", ["", "new", "same"])
def test_scaled_value_times_a_loaded_input_is_one_loop(shape, w_kind, out_dtype, order, cast):
    """x * s (s per row), rounded to bf16 or not, times w, with nothing else reading the
    values between, runs as one loop (w read in place or from its cached row, the result
    written into the output): bit for bit the result of the instructions run apart (the
    value w multiplies stored too), and the reference within TOL."""
    g = torch.Generator().manual_seed(20)
    x = torch.randn(shape, generator=g).bfloat16()
    kind, dtype = w_kind.split()
    w_shape = shape[-1:] if kind == "row" else shape
    w = torch.randn(w_shape, generator=g).to(
        torch.float32 if dtype == "fp32" else torch.bfloat16 if dtype == "bf16" else torch.half
    )
    reduced = [False]
    (got,) = check(_scale_mul_program(order, cast, ""), [x, w], shape, [out_dtype], reduced)
    apart, _ = vm.run(_scale_mul_program(order, cast, "c"), [x, w], shape, [out_dtype] * 2)
    torch.testing.assert_close(got, apart, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape", [(4, 1024), (3, 2049), (7, 5), (1, 1)], ids=str)
@pytest.mark.parametrize("reduce_op", [Op.REDUCE_MEAN, Op.REDUCE_SUM])
def test_a_bf16_input_squared_and_summed_is_widened_by_the_sum(shape, reduce_op) -> None:
    """A bf16 input loaded for the row sum of its own square (then used again) is widened by
    the sum's loop: bit for bit the result of the same values given as fp32 (loaded apart)."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(shape, generator=g).bfloat16()
    w = torch.randn(shape[-1:], generator=g)
    instrs = [
        Instr(Op.LOAD, 0, 0),
        Instr(Op.MUL, 1, 0, 0),
        Instr(reduce_op, 2, 1),
        Instr(Op.RSQRT, 1, 2),
        Instr(Op.MUL, 3, 0, 1),
        Instr(Op.LOAD, 4, 1),
        Instr(Op.MUL, 5, 3, 4),
        Instr(Op.STORE, -1, 0, 5),
        Instr(Op.STORE, -1, 1, 2),
    ]
    p = program(*instrs, n_inputs=2, n_outputs=2)
    outs, reduced = [torch.bfloat16, torch.float32], [False, True]
    got = check(p, [x, w], shape, outs, reduced, tol=ROW_TOL)
    apart = vm.run(p, [x.float(), w], shape, outs, reduced)
    for a, b in zip(got, apart, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("keep", ["w", "out"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_value_read_again_keeps_its_registers(keep, out_dtype) -> None:
    """When w or the result is read again, their registers still hold them; a scalar s
    (no reduction) takes the loop too."""
    g = torch.Generator().manual_seed(21)
    x, w = torch.randn(2, 6, 300, generator=g)
    for scalar in (False, True):
        p = _scale_mul_program("full first", "new", keep, scalar=scalar)
        check(p, [x, w], (6, 300), [out_dtype, torch.float32])


def test_scaled_value_times_a_row_broadcast_or_strided_input() -> None:
    """w one value per row (the loop is not taken) and a transposed w (loaded first)."""
    g = torch.Generator().manual_seed(22)
    x = torch.randn(6, 40, generator=g)
    p = _scale_mul_program("full last", "new", "")
    check(p, [x, torch.randn(6, 1, generator=g)], (6, 40), [torch.bfloat16])
    check(p, [x, torch.randn(40, 6, generator=g).t()], (6, 40), [torch.float32])


def test_a_bound_launch_equals_the_kernel_call_with_views_broadcasts_and_strides() -> None:
    # operand 0: a (4, 1, 6) arg seen as (4, 6), transposed storage; operand 1: a (6,) arg
    # broadcast along the rows; operand 2: the first arg again; output allocated as (4, 1, 6)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 1, 4, generator=g).permute(2, 1, 0)
    w = torch.randn(6, generator=g)
    p = program(
        Instr(Op.LOAD, 0, 0),
        Instr(Op.LOAD, 1, 1),
        Instr(Op.MUL, 2, 0, 1),
        Instr(Op.LOAD, 1, 2),
        Instr(Op.ADD, 0, 2, 1),
        Instr(Op.STORE, -1, 0, 0),
        n_inputs=3,
    )
    kernel = vm.Kernel(p, [torch.float32])
    launch = kernel.bind((4, 6), [a, w], [(0, (4, 6)), (1, (6,)), (0, (4, 6))], [(4, 1, 6)])
    (got,) = launch([a, w])
    (want,) = kernel([a.view(4, 6), w, a.view(4, 6)], (4, 6))
    assert got.shape == (4, 1, 6)
    assert torch.equal(got.view(4, 6), want)
    assert torch.equal(got.view(4, 6), a.view(4, 6) * w + a.view(4, 6))


def test_bind_refuses_bad_signatures_and_long_rows_at_each_call() -> None:
    kernel = vm.Kernel(unary(Op.EXP), [torch.float32])
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="moves elements"):
        kernel.bind((3, 4), [x], [(0, (4, 3))], [(3, 4)])
    with pytest.raises(ValueError, match="does not broadcast"):
        kernel.bind((3, 5), [x], [(0, (3, 4))], [(3, 5)])
    with pytest.raises(ValueError, match="output 0"):
        kernel.bind((3, 4), [x], [(0, (3, 4))], [(4, 3)])
    with pytest.raises(ValueError, match="1 inputs and 1 outputs"):
        kernel.bind((3, 4), [x], [], [(3, 4)])
    row = _lib.library()[0].dvm_max_row() + 1
    reducing = program(
        Instr(Op.LOAD, 0, 0), Instr(Op.REDUCE_SUM, 1, 0), Instr(Op.STORE, -1, 0, 1), n_inputs=1
    )
    long = torch.empty((1, row), device="meta")
    kernel = vm.Kernel(reducing, [torch.float32])
    launch = kernel.bind((1, row), [long], [(0, (1, row))], [(1, row)])
    for _ in range(2):
        with pytest.raises(vm.VMError, match="rows of"):
            launch([torch.zeros(1, row)])


def test_a_bound_launch_refuses_args_other_than_those_it_was_bound_for() -> None:
    kernel = vm.Kernel(unary(Op.EXP), [torch.float32])
    x = torch.randn(64, 256)
    launch = kernel.bind((64, 256), [x], [(0, (64, 256))], [(64, 256)])
    with pytest.raises(ValueError, match=r"arg 0 is torch.float32 \(2, 256\); .* bound for"):
        launch([x[:2]])  # unchecked, the VM reads 62 rows past its end
    with pytest.raises(ValueError, match=r"arg 0 is torch\.bfloat16"):
        launch([x.bfloat16()])
    with pytest.raises(ValueError, match="bound for 1 args, got 2"):
        launch([x, x])
    with pytest.raises(TypeError, match="arg 0 is a float"):
        launch([1.0])
    with pytest.raises(ValueError, match="dense CPU"):
        launch([x.to_sparse()])
    with pytest.raises(ValueError, match="arg 0 is a lazily negated view"):
        launch([torch.randn(64, 256, dtype=torch.complex64).conj().imag])
    (got,) = launch([x.t().contiguous().t()])
    assert torch.equal(got, launch.run([x])[0])
