"""triangle_attention: the reference against a per-(batch, i, head) loop of plain softmax
attention in float64 and its backward against autograd of that loop; the C++ kernel (forward
and backward, every installed build) against the float64 reference; the op through
``torch.ops.spore`` (eager, autograd, torch.compile); input errors and the library refusing
bad arguments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import triangle_attention as op

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _inputs(batch, i, j, keys, h, d, dtype, seed, bias=True, mask=0.3):
    """q, k, v, bias (or None) and a bool mask dropping about ``mask`` of the keys (or None)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, i, j, h, d, generator=g)
    k = torch.randn(*batch, i, keys, h, d, generator=g) * 1.5
    v = torch.randn(*batch, i, keys, h, d, generator=g)
    b = torch.randn(*batch, h, j, keys, generator=g) * 2 if bias else None
    m = torch.rand(*batch, i, keys, generator=g) >= mask if mask is not None else None
    cast = (t if t is None else t.to(dtype) for t in (q, k, v, b))
    return (*cast, m)


def _loop(q, k, v, bias, mask, scale=None):
    """Plain softmax attention one (batch, i, head) at a time, in float64; no key: zeros."""
    *batch, i_n, j_n, h_n, d = q.shape
    scale = d**-0.5 if scale is None else scale
    flat = [t.reshape(-1, *t.shape[len(batch) :]) if t is not None else None for t in (q, k, v)]
    fb = bias.reshape(-1, *bias.shape[len(batch) :]) if bias is not None else None
    fm = mask.reshape(-1, *mask.shape[len(batch) :]) if mask is not None else None
    rows = []
    for b in range(flat[0].shape[0]):
        for i in range(i_n):
            for h in range(h_n):
                qq, kk, vv = (t[b, i, :, h].double() for t in flat)
                s = qq @ kk.T * scale
                if fb is not None:
                    s = s + fb[b, h].double()
                if fm is not None:
                    s = s.masked_fill(~fm[b, i], float("-inf"))
                if fm is not None and not bool(fm[b, i].any()):
                    rows.append(qq * 0.0)  # zeros, still in the graph
                else:
                    rows.append(torch.softmax(s, -1) @ vv)
    out = torch.stack(rows).reshape(-1, i_n, h_n, j_n, d).transpose(2, 3)
    return out.reshape(*batch, i_n, j_n, h_n, d)


def _grads(fn, args, grad):
    """Gradients of fn(*args) (float64 leaves) for the tensors among q, k, v, bias."""
    leaves = [a.detach().double().requires_grad_() if a is not None else None for a in args[:4]]
    out = fn(*leaves, *args[4:])
    wrt = [t for t in leaves if t is not None]
    return torch.autograd.grad(out, wrt, grad.double(), allow_unused=True, materialize_grads=True)


SHAPES = st.tuples(
    st.sampled_from([(), (1,), (2,), (1, 2)]),  # batch dims
    st.integers(1, 4),  # I
    st.integers(1, 9),  # J
    st.integers(1, 9),  # K
    st.integers(1, 3),  # H
    st.sampled_from([1, 3, 8, 16]),  # D
)


@settings(max_examples=25, deadline=None)
@given(
    shape=SHAPES,
    with_bias=st.booleans(),
    mask=st.sampled_from([None, 0.0, 0.4, 0.9]),
    seed=st.integers(0, 2**16),
)
def test_reference_and_its_backward_match_a_loop_of_plain_attention(
    shape, with_bias, mask, seed
) -> None:
    batch, i, j, keys, h, d = shape
    args = _inputs(batch, i, j, keys, h, d, torch.float64, seed, with_bias, mask)
    expected = _loop(*args)
    torch.testing.assert_close(op.reference(*args), expected)
    grad = torch.randn(expected.shape, dtype=torch.float64)
    want = _grads(_loop, args, grad)
    got = op.reference_backward(grad, *args, expected, None)
    got = [g for g, a in zip(got, args[:4], strict=True) if a is not None]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_op_gradcheck_and_compile() -> None:
    args = _inputs((2,), 2, 3, 4, 2, 4, torch.float64, 1, mask=0.4)
    mask = args[4].clone()
    mask[0, 1] = False  # a fully masked row: zeros, zero gradients
    leaves = [t.requires_grad_() for t in args[:4]]

    def run(q, k, v, b):
        return torch.ops.spore.triangle_attention(q, k, v, b, mask)

    assert torch.autograd.gradcheck(run, leaves, fast_mode=True, check_batched_grad=True)
    out = run(*leaves)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    compiled = torch.compile(run, fullgraph=True)
    torch.testing.assert_close(compiled(*leaves), out)
    (dq,) = torch.autograd.grad(compiled(*leaves).sum(), leaves[0])
    assert torch.equal(dq[0, 1], torch.zeros_like(dq[0, 1]))


def _bad_cases():
    q, k, v, b, m = _inputs((2,), 3, 5, 4, 2, 8, torch.float32, 2)
    good = dict(q=q, k=k, v=v, bias=b, mask=m)
    return [
        (good | dict(q=q.long()), TypeError, "q must be a floating-point tensor"),
        (good | dict(k=k.double()), TypeError, "one dtype"),
        (good | dict(bias=b.bfloat16()), TypeError, "one dtype"),
        (good | dict(q=q[0, 0, 0]), ValueError, r"4-D or more"),
        (good | dict(v=v[:, :, :3]), ValueError, "k and v must have one shape"),
        (good | dict(k=k[:, :2], v=v[:, :2]), ValueError, "q's batch dims and I"),
        (good | dict(k=k[..., :1, :], v=v[..., :1, :]), ValueError, "head count H = 2"),
        (good | dict(k=k[..., :4], v=v[..., :4]), ValueError, "head dim D = 8"),
        (good | dict(bias=b[:, :, :, :3]), ValueError, r"bias must be \[\*, H, J, K\]"),
        (good | dict(bias=b[0]), ValueError, r"bias must be \[\*, H, J, K\]"),
        (good | dict(mask=m.float()), TypeError, "mask must be a bool tensor"),
        (good | dict(mask=m[:, :, :2]), ValueError, r"mask must be \[\*, I, K\]"),
    ]


@pytest.mark.parametrize(("kwargs", "error", "message"), _bad_cases())
def test_bad_input_is_a_clear_error(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.triangle_attention(**kwargs)
    with pytest.raises(error, match=message):
        op.reference(**kwargs)


def test_bad_scale_is_a_clear_error() -> None:
    q, k, v, b, m = _inputs((), 2, 3, 3, 1, 4, torch.float32, 3)
    with pytest.raises(ValueError, match="scale must be finite"):
        torch.ops.spore.triangle_attention(q, k, v, b, m, float("nan"))


# The C++ kernel ----------------------------------------------------------------------------


def _close(got, want, dtype):
    """Within TOL[dtype] relative to the largest expected value (float64 oracle)."""
    assert got.dtype == dtype
    assert got.shape == want.shape
    tol = TOL[dtype]
    scale = max(float(want.detach().abs().max()), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)


def _kernel_vs_oracle(args, dtype, seed=0):
    """Forward and backward of the C++ kernel against the float64 reference on the same
    (rounded) inputs; gradients for q, k, v and bias."""
    assert dispatch.explain(op.OP, *args).chosen == "kernels"
    wide = tuple(t.double() if t is not None and t.is_floating_point() else t for t in args)
    expected = op.reference(*wide)
    out = torch.ops.spore.triangle_attention(*args)
    _close(out, expected, dtype)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    bwd = (g, *args, out, None)
    assert dispatch.explain(op.OP + "_backward", *bwd).chosen == "kernels"
    got = torch.ops.spore.triangle_attention_backward(*bwd)
    want = op.reference_backward(g.double(), *wide, expected, None)
    for a, w, t in zip(got, want, args[:4], strict=True):
        if t is None:
            assert a.numel() == 0
        else:
            _close(a, w, dtype)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.tuples(
        st.sampled_from([(), (1,), (2,), (1, 2)]),
        st.integers(1, 4),  # I
        st.sampled_from([1, 2, 7, 13, 49]),  # J (49: a second 48-row tile)
        st.sampled_from([1, 3, 16, 17, 33]),  # K
        st.integers(1, 3),  # H
        st.sampled_from([1, 7, 16, 32, 33]),  # D
    ),
    with_bias=st.booleans(),
    mask=st.sampled_from([None, 0.0, 0.5, 0.95]),
    dtype=st.sampled_from(list(TOL)),
    seed=st.integers(0, 2**16),
)
# K = 3, D = 1 in bf16: delta taken as rowsum(grad * out) with out rounded put dq 2.5 % off.
@example(shape=((), 3, 13, 3, 2, 1), with_bias=False, mask=None, dtype=torch.bfloat16, seed=0)
def test_kernel_forward_and_backward_match_the_float64_reference(
    shape, with_bias, mask, dtype, seed
) -> None:
    """Including rows with every key masked (mask 0.95 on few keys) and no bias."""
    batch, i, j, keys, h, d = shape
    _kernel_vs_oracle(_inputs(batch, i, j, keys, h, d, dtype, seed, with_bias, mask), dtype, seed)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_kernel_across_key_tiles_with_a_skipped_tile(dtype) -> None:
    """More than one 128-key tile (K = 300) and 48-row tile (J = 61); for some rows i the
    whole first key tile is masked (the kernel skips it), one row i is fully masked."""
    q, k, v, b, m = _inputs((1,), 3, 61, 300, 2, 16, dtype, 4, mask=0.2)
    m[0, 1, :128] = False
    m[0, 2] = False
    _kernel_vs_oracle((q, k, v, b, m), dtype)
    out = torch.ops.spore.triangle_attention(q, k, v, b, m)
    assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))


def test_fully_masked_rows_are_zero_with_zero_gradients_in_the_kernel() -> None:
    q, k, v, b, m = _inputs((2,), 3, 5, 6, 2, 8, torch.float32, 5)
    m[1, 0] = False
    leaves = [t.requires_grad_() for t in (q, k, v, b)]
    out = torch.ops.spore.triangle_attention(*leaves, m)
    assert torch.equal(out[1, 0], torch.zeros_like(out[1, 0]))
    dq, dk, dv, db = torch.autograd.grad(out, leaves, torch.randn_like(out))
    for grad in (dq[1, 0], dk[1, 0], dv[1, 0]):
        assert torch.equal(grad, torch.zeros_like(grad))
    assert bool(torch.isfinite(db).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_garbage_at_masked_keys_does_not_reach_the_kept_ones(dtype) -> None:
    """NaN in a masked key's k, v or bias, or a +inf bias or v there (padding holding
    garbage): the kernel added the mask's -inf to the score, and -inf + NaN (or + inf) is a
    NaN that spread over the row; and a masked key's v times its 0 probability, and its k
    times its 0 dS, were 0 * NaN (or inf): NaN in the row, in dP and in dq, in the kernel and
    the reference alike. Both, forward and backward, are the float64 reference's on clean
    padding (K = 300 also has a key tile whose keys are all masked, which the kernel skips)."""
    for keys, masked in ((37, [3, 30]), (300, [3, *range(128, 256)])):
        q, k, v, b, m = _inputs((1,), 2, 5, keys, 2, 8, dtype, 11)
        m[..., masked] = False
        k[0, :, 3] = float("nan")
        v[0, :, 3] = float("inf")
        v[0, :, masked[-1]] = float("nan")
        b[..., masked[-1]] = float("nan")
        b[..., 3] = float("inf")
        clean_k, clean_v, clean_b = k.clone(), v.clone(), b.clone()
        clean_k[0, :, masked] = clean_v[0, :, masked] = clean_b[..., masked] = 0
        clean = [t.double() for t in (q, clean_k, clean_v, clean_b)]
        want = op.reference(*clean, m)
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(keys))
        want_grads = op.reference_backward(g.double(), *clean, m, want, None)
        spore = torch.ops.spore
        for forward, backward in (
            (spore.triangle_attention, spore.triangle_attention_backward),
            (op.reference, op.reference_backward),
        ):
            out = forward(q, k, v, b, m)
            assert bool(torch.isfinite(out).all())
            _close(out, want, dtype)
            grads = backward(g.to(dtype), q, k, v, b, m, out, None)
            for got, w in zip(grads, want_grads, strict=True):
                _close(got, w, dtype)


def test_a_nan_bias_makes_the_whole_row_and_its_gradients_nan_as_the_reference() -> None:
    """One NaN bias makes its row's probabilities NaN: dv = P^T dO is NaN at every key. The
    kernel took the row's NaN sum as a fully masked row's 0 and kept dv NaN at one key."""
    q, k, v, b, _ = _inputs((), 1, 2, 4, 1, 4, torch.float32, 3, mask=None)
    b[0, 0, 1] = float("nan")
    out = op.reference(q, k, v, b, None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    got = torch.ops.spore.triangle_attention_backward(g, q, k, v, b, None, out, None)
    want = op.reference_backward(g, q, k, v, b, None, out, None)
    assert bool(want[2].isnan().all())
    for a, w in zip(got, want, strict=True):
        assert torch.equal(a.isnan(), w.isnan())


@pytest.mark.parametrize("where", ["k", "bias", "overflow", "masked key"])
def test_a_plus_inf_score_makes_its_row_nan_as_the_reference(where) -> None:
    """A +inf score (an inf in k or the bias, or q.k past float32) makes its row's softmax NaN
    (inf - inf), as torch's: the kernel made 2^(inf - inf) a 0, a row of zeros and finite
    gradients. An inf at a key the mask drops reaches no row."""
    q, k, v, b, _ = _inputs((), 2, 3, 5, 1, 4, torch.float32, 5, mask=None)
    mask = None
    if where in ("k", "masked key"):
        k[0, 1, 0, 0] = float("inf")
    elif where == "bias":
        b[0, 1, 2] = float("inf")
    else:
        q[1, 1, 0, 0] = k[1, 3, 0, 0] = 1e30
    if where == "masked key":
        mask = torch.ones(2, 5, dtype=torch.bool)
        mask[0, 1] = False
    args = (q, k, v, b, mask)
    got, want = torch.ops.spore.triangle_attention(*args), op.reference(*args)
    assert bool(want.isnan().any()) == (where != "masked key")
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(0))
    grads = torch.ops.spore.triangle_attention_backward(g, *args, want, None)
    for a, w in zip(grads, op.reference_backward(g, *args, want, None), strict=True):
        assert torch.equal(a.isnan(), w.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_finfo_min_bias_masks_as_the_reference_does(dtype) -> None:
    """An additive mask of finfo.min (as Hugging Face writes them) on every key of a row, and a
    bias of 3e38 on one key of another: bias * log2 e overflowed to -inf (+inf), and the first
    row came out zeros (the second too), with zero gradients. The reference in float32 on the
    same values averages v over the masked row and picks the one key."""
    q, k, v, b, _ = _inputs((1,), 2, 5, 7, 2, 8, dtype, 12, mask=None)
    b[..., 1, :] = torch.finfo(dtype).min
    b[..., 4, :] = -1e9  # an OpenFold-style mask (the CUDA kernel's gradients were off there)
    b[0, 0, 3, 2] = 3e38
    assert dispatch.explain(op.OP, q, k, v, b).chosen == "kernels"
    leaves = [t.requires_grad_() for t in (q, k, v, b)]
    out = torch.ops.spore.triangle_attention(*leaves)
    wide = [t.detach().float().requires_grad_() for t in leaves]
    want = op.reference(*wide)
    _close(out[0, 0, 1, 0], v[0, 0, :, 0].double().mean(0), dtype)
    _close(out[0, :, 3, 0], v[0, :, 2, 0].double(), dtype)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    wanted = torch.autograd.grad(want, wide, grad.float())
    for g, w in zip((out, *got), (want, *wanted), strict=True):
        _close(g, w.double(), dtype)


def test_op_gradients_through_autograd_match_float64_autograd() -> None:
    """The op's own backward (C++ kernel) against autograd of the loop oracle in float64, and
    gradcheck of the float64 op (reference path)."""
    args = _inputs((1,), 4, 9, 7, 2, 16, torch.float32, 6, mask=0.3)
    leaves = [t.requires_grad_() for t in args[:4]]
    out = torch.ops.spore.triangle_attention(*leaves, args[4])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    want = _grads(_loop, args, grad)
    for g, w in zip(got, want, strict=True):
        _close(g, w, torch.float32)


def test_i_equal_one_is_attention_with_pair_bias() -> None:
    """Attention over single tokens: q [B, 1, N, H, D], bias [B, H, N, N], mask [B, 1, N]."""
    q, k, v, b, m = _inputs((2,), 1, 23, 23, 4, 16, torch.float32, 7, mask=0.1)
    _kernel_vs_oracle((q, k, v, b, m), torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[:, 0].transpose(1, 2).double(),
        k[:, 0].transpose(1, 2).double(),
        v[:, 0].transpose(1, 2).double(),
        attn_mask=b.double().masked_fill(~m[:, :, None, :], float("-inf")),
    )
    _close(torch.ops.spore.triangle_attention(q, k, v, b, m)[:, 0], sdpa.transpose(1, 2), q.dtype)


def test_scale_and_non_contiguous_inputs() -> None:
    q, k, v, b, m = _inputs((2,), 3, 6, 5, 2, 8, torch.float32, 8)
    kt = k.transpose(-2, -3).contiguous().transpose(-2, -3)  # same values, other strides
    bt = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not kt.is_contiguous()
    assert not bt.is_contiguous()
    args = (q, kt, v, bt, m, 0.3)
    assert dispatch.explain(op.OP, *args).chosen == "kernels"
    out = torch.ops.spore.triangle_attention(*args)
    _close(out, _loop(q, k, v, b, m, 0.3), torch.float32)
    assert not torch.allclose(out, torch.ops.spore.triangle_attention(q, k, v, b, m))


def test_what_the_kernel_does_not_take_runs_the_reference() -> None:
    q, k, v, b, m = _inputs((), 2, 4, 3, 2, 8, torch.float64, 9)
    assert dispatch.explain(op.OP, q, k, v, b, m).chosen == "reference"
    empty = _inputs((), 2, 4, 0, 2, 8, torch.float32, 9)
    assert dispatch.explain(op.OP, *empty).chosen == "reference"
    out = torch.ops.spore.triangle_attention(*empty)
    assert torch.equal(out, torch.zeros(2, 4, 2, 8))
    headless = [t.requires_grad_() for t in _inputs((), 2, 4, 3, 2, 0, torch.float32, 9)[:4]]
    out = torch.ops.spore.triangle_attention(*headless)  # D = 0: 1/sqrt(D) raised
    assert out.shape == (2, 4, 2, 0)
    out.sum().backward()
    assert [t.grad.shape for t in headless] == [t.shape for t in headless]


def test_compiles_fullgraph_with_the_kernel() -> None:
    q, k, v, b, m = _inputs((1,), 3, 8, 8, 2, 16, torch.float32, 10)
    leaves = [t.requires_grad_() for t in (q, k, v, b)]
    compiled = torch.compile(
        lambda *a: torch.ops.spore.triangle_attention(*a, m) * 2, fullgraph=True
    )
    out = compiled(*leaves)
    _close(out, _loop(q, k, v, b, m) * 2, torch.float32)
    got = torch.autograd.grad(out.sum(), leaves)
    want = _grads(lambda *a: _loop(*a) * 2, (q, k, v, b, m), torch.ones_like(out))
    for g, w in zip(got, want, strict=True):
        _close(g, w, torch.float32)


def _c_args(dtype=torch.float32):
    q, k, v, b, m = _inputs((2,), 3, 7, 5, 2, 8, dtype, 11)
    out = torch.empty_like(q)
    return q, k, v, b, m, out


def _sizes(q, k):
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.shape[4])


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    lib = _lib.load(isa)
    fwd = _lib.function("spore_triangle_attention", op._FWD, lib)
    bwd = _lib.function("spore_triangle_attention_backward", op._BWD, lib)
    for dtype in TOL:
        q, k, v, b, m, out = _c_args(dtype)
        ptrs = [t.data_ptr() for t in (q, k, v, b, m, out)]
        assert fwd(*ptrs, *_sizes(q, k), 0.5, _lib.dtype_code(q), 2) == 0
        wide = tuple(t.double() if t.is_floating_point() else t for t in (q, k, v, b, m))
        expected = op.reference(*wide, 0.5)
        _close(out, expected, dtype)
        g = torch.randn_like(out)
        grads = [torch.empty_like(t) for t in (q, k, v, b)]
        ptrs = [t.data_ptr() for t in (g, q, k, v, b, m, *grads)]
        assert bwd(*ptrs, *_sizes(q, k), 0.5, _lib.dtype_code(q), 2) == 0
        want = op.reference_backward(g.double(), *wide, expected, 0.5)
        for a, w in zip(grads, want, strict=True):
            _close(a, w, dtype)


def test_the_library_refuses_bad_arguments_and_writes_nothing() -> None:
    """Status 1 (bad argument) or 2 (dtype), outputs untouched; never a crash."""
    fwd = _lib.function("spore_triangle_attention", op._FWD)
    bwd = _lib.function("spore_triangle_attention_backward", op._BWD)
    q, k, v, b, m, out = _c_args()
    out.fill_(7.0)
    good = [t.data_ptr() for t in (q, k, v, b, m, out)]
    sizes = _sizes(q, k)
    huge = 1 << 40
    for ptrs, dims, code, threads in [
        ([None, *good[1:]], sizes, 0, 2),  # null q
        ([*good[:1], None, *good[2:]], sizes, 0, 2),  # null k
        ([*good[:5], None], sizes, 0, 2),  # null out
        (good, (2, -1, 7, 5, 2, 8), 0, 2),  # negative size
        (good, sizes, 0, 0),  # no thread
        (good, (huge, huge, 7, 5, 2, 8), 0, 2),  # element counts overflow int64
    ]:
        assert fwd(*ptrs, *dims, 0.5, code, threads) == 1
    assert fwd(*good, *sizes, 0.5, 9, 2) == 2
    assert bool((out == 7.0).all())
    grads = [torch.full_like(t, 7.0) for t in (q, k, v, b)]
    gptrs = [t.data_ptr() for t in grads]
    base = [out.data_ptr(), *good[:5]]
    for ptrs in (
        [*base, *gptrs[:3], None],  # bias without dbias
        [*base[:4], None, base[5], *gptrs],  # dbias without bias
        [None, *base[1:], *gptrs],  # null grad
        [*base, None, *gptrs[1:]],  # null dq
    ):
        assert bwd(*ptrs, *sizes, 0.5, 0, 2) == 1
    assert bwd(*base, *gptrs, *sizes, 0.5, 9, 2) == 2
    assert all(bool((t == 7.0).all()) for t in grads)
    with pytest.raises(_lib.KernelError, match="bad argument"):
        _lib.call("spore_triangle_attention", op._FWD, *[0] * 6, 1, 1, 1, 1, 1, 1, 1.0, 0, 1)


def test_the_library_gives_zeros_when_no_row_meets_a_key() -> None:
    """K = 0: zero output and zero dq; D = 0 with a bias: zero dbias (null pointers allowed
    for tensors without elements)."""
    fwd = _lib.function("spore_triangle_attention", op._FWD)
    bwd = _lib.function("spore_triangle_attention_backward", op._BWD)
    out = torch.full((1, 2, 3, 2, 4), 7.0)
    assert fwd(1, None, None, None, None, out.data_ptr(), 1, 2, 3, 0, 2, 4, 1.0, 0, 2) == 0
    assert torch.equal(out, torch.zeros_like(out))
    db = torch.full((1, 2, 3, 5), 7.0)
    bias = torch.randn(1, 2, 3, 5)
    ptrs = [None, None, None, None, bias.data_ptr(), None, None, None, None, db.data_ptr()]
    assert bwd(*ptrs, 1, 2, 3, 5, 2, 0, 1.0, 0, 2) == 0
    assert torch.equal(db, torch.zeros_like(db))


def test_the_additive_mask_baseline_equals_the_op_where_every_row_has_a_key() -> None:
    """The benchmarks' lean composite (mask as a -1e9 bias) computes the same attention unless
    a row has no key left (then it attends uniformly where the op gives zeros)."""
    q, k, v, b, m = _inputs((1,), 3, 6, 7, 2, 8, torch.float32, 12, mask=0.3)
    m[..., 0] = True  # every row keeps a key
    expected = _loop(q, k, v, b, m)
    _close(op.additive_mask_composite(q, k, v, b, m), expected, torch.float32)
    m[0, 1] = False
    uniform = v[0, 1].double().mean(0)  # [H, D]: the mean value row of row i = 1
    got = op.additive_mask_composite(q, k, v, b, m)[0, 1]
    _close(got, uniform.expand(6, 2, 8), torch.float32)
    assert torch.equal(
        torch.ops.spore.triangle_attention(q, k, v, b, m)[0, 1], torch.zeros(6, 2, 8)
    )
