"""block_sparse_attention: the op (its C++ CPU kernel) and its reference against dense SDPA
(float64) under the block lists' dense mask, the kernel against the reference, the block-list
conventions, the input errors, and the library refusing what would read out of bounds."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from spore import dispatch
from spore_kernels import _lib
from spore_kernels.ops import block_sparse_attention as op

TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _qkv(b, h, sq, skv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for s in (sq, skv, skv))
    return q.to(dtype), (k * 2).to(dtype), v.to(dtype)


def _lists(b, h, sq, skv, bs, m, index_dtype, seed, garbage=True):
    """Random distinct block lists of width m and random counts 0..m; past the count, junk."""
    g = torch.Generator().manual_seed(seed)
    nq, nk = op.blocks(sq, bs), op.blocks(skv, bs)
    index = torch.rand(b, h, nq, nk, generator=g).argsort(-1)[..., :m]
    count = torch.randint(0, m + 1, (b, h, nq), generator=g)
    if garbage:  # entries past the count are ignored, whatever they hold
        junk = torch.randint(-5, nk + 5, index.shape, generator=g)
        index = torch.where(torch.arange(m) < count.unsqueeze(-1), index, junk)
    return index.to(index_dtype), count.to(index_dtype)


def _oracle(q, k, v, index, count, bs, scale=None):
    """Dense SDPA in float64 under the dense mask; query rows with no key are zeros."""
    mask = op.dense_mask(index, count, bs, q.shape[2], k.shape[2])
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, scale=scale
    )
    return torch.where(mask.any(-1, keepdim=True), out, 0.0)


def _close(out, expected, dtype):
    assert out.dtype == dtype
    assert out.shape == expected.shape
    tol = TOL.get(dtype, 1e-9)  # float64: the reference, in float64
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@settings(max_examples=80, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    sq=st.integers(0, 70),
    skv=st.integers(0, 70),
    bs=st.sampled_from([1, 3, 8, 16, 32]),
    d=st.sampled_from([1, 4, 8, 13]),
    dtype=st.sampled_from(list(TOL)),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    width=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_sdpa_under_the_block_mask(
    b, h, sq, skv, bs, d, dtype, index_dtype, width, seed
) -> None:
    m = round(width * op.blocks(skv, bs))
    q, k, v = _qkv(b, h, sq, skv, d, dtype, seed)
    index, count = _lists(b, h, sq, skv, bs, m, index_dtype, seed)
    expected = _oracle(q, k, v, index, count, bs)
    _close(torch.ops.spore.block_sparse_attention(q, k, v, index, count, bs), expected, dtype)
    _close(op.reference(q, k, v, index, count, bs), expected, dtype)


def test_dense_mask_matches_the_block_lists_read_one_by_one() -> None:
    bs, sq, skv = 4, 10, 13
    index, count = _lists(2, 2, sq, skv, bs, 3, torch.int64, 0)
    expected = torch.zeros(2, 2, sq, skv, dtype=torch.bool)
    for b in range(2):
        for h in range(2):
            for i in range(op.blocks(sq, bs)):
                for j in index[b, h, i, : count[b, h, i]].tolist():
                    expected[b, h, i * bs : (i + 1) * bs, j * bs : (j + 1) * bs] = True
    assert torch.equal(op.dense_mask(index, count, bs, sq, skv), expected)


def test_a_query_block_with_no_kv_block_gets_zeros() -> None:
    q, k, v = _qkv(1, 2, 20, 24, 8, torch.float32, 1)
    index, count = _lists(1, 2, 20, 24, 8, 2, torch.int32, 1, garbage=False)
    count.fill_(2)
    count[0, 1, 1] = 0
    count[0, 0] = 0
    out = torch.ops.spore.block_sparse_attention(q, k, v, index, count, 8)
    assert torch.equal(out[0, 0], torch.zeros(20, 8))
    assert torch.equal(out[0, 1, 8:16], torch.zeros(8, 8))
    assert out[0, 1, :8].abs().sum() > 0
    empty = torch.zeros(1, 2, 3, 0, dtype=torch.int32)
    out = torch.ops.spore.block_sparse_attention(q, k, v, empty, count.zero_(), 8)
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.parametrize(("sq", "skv", "m"), [(0, 16, 2), (16, 0, 2), (16, 16, 0)])
def test_nothing_to_attend_to_gives_zero_gradients(sq: int, skv: int, m: int) -> None:
    """No queries, no keys or no block listed: the output is zeros and so are the gradients
    of q, k and v (they were None: the zeros were made apart from the inputs)."""
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (sq, skv, skv))
    nq = op.blocks(sq, 8)
    index = torch.zeros(1, 2, nq, m, dtype=torch.int32)
    count = torch.full((1, 2, nq), m if skv else 0, dtype=torch.int32)  # no key: none listed
    out = torch.ops.spore.block_sparse_attention(q, k, v, index, count, 8)
    assert torch.equal(out, torch.zeros_like(q))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_every_block_listed_is_full_attention_and_order_does_not_matter() -> None:
    q, k, v = _qkv(2, 2, 33, 41, 16, torch.float32, 2)
    bs = 8
    nq, nk = op.blocks(33, bs), op.blocks(41, bs)
    index = torch.rand(2, 2, nq, nk, generator=torch.Generator().manual_seed(2)).argsort(-1)
    count = torch.full((2, 2, nq), nk)
    out = torch.ops.spore.block_sparse_attention(q, k, v, index, count, bs)
    full = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    _close(out, full, torch.float32)
    in_order = torch.ops.spore.block_sparse_attention(q, k, v, index.sort(-1).values, count, bs)
    torch.testing.assert_close(in_order, out, rtol=1e-6, atol=1e-6)


def test_scale_is_applied() -> None:
    q, k, v = _qkv(1, 2, 19, 19, 8, torch.float32, 3)
    index, count = _lists(1, 2, 19, 19, 4, 3, torch.int64, 3)
    out = torch.ops.spore.block_sparse_attention(q, k, v, index, count, 4, scale=0.7)
    _close(out, _oracle(q, k, v, index, count, 4, scale=0.7), torch.float32)
    default = torch.ops.spore.block_sparse_attention(q, k, v, index, count, 4)
    assert not torch.allclose(out, default)


def test_the_reference_scores_in_chunks_with_the_same_result(monkeypatch) -> None:
    q, k, v = _qkv(2, 2, 45, 37, 8, torch.float32, 4)
    index, count = _lists(2, 2, 45, 37, 4, 5, torch.int64, 4)
    whole = op.reference(q, k, v, index, count, 4)
    monkeypatch.setattr(op, "CHUNK_ELEMENTS", 1)  # one query block at a time
    torch.testing.assert_close(op.reference(q, k, v, index, count, 4), whole)
    _close(whole, _oracle(q, k, v, index, count, 4), torch.float32)


def test_gradients_are_the_references_and_match_dense_sdpa() -> None:
    q, k, v = (t.double().requires_grad_() for t in _qkv(1, 2, 11, 13, 4, torch.float32, 5))
    index, count = _lists(1, 2, 11, 13, 4, 2, torch.int64, 5)
    count[0, 0, 0] = 0  # an empty query block: zero gradient, no NaN

    def run(a, b, c):
        return torch.ops.spore.block_sparse_attention(a, b, c, index, count, 4)

    assert torch.autograd.gradcheck(run, (q, k, v))
    grads = torch.autograd.grad(run(q, k, v).sum(), (q, k, v))
    expected = torch.autograd.grad(_oracle(q, k, v, index, count, 4).sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_compiles_fullgraph() -> None:
    q, k, v = _qkv(1, 2, 24, 24, 8, torch.float32, 6)
    index, count = _lists(1, 2, 24, 24, 8, 2, torch.int32, 6)
    compiled = torch.compile(
        lambda a, b, c: torch.ops.spore.block_sparse_attention(a, b, c, index, count, 8) * 2,
        fullgraph=True,
    )
    torch.testing.assert_close(compiled(q, k, v), op.reference(q, k, v, index, count, 8) * 2)


def test_compiled_training_matches_eager() -> None:
    """torch.compile(fullgraph) of forward + backward: the backward reruns the reference on
    fake tensors, whose block lists used to be read for checking (a data-dependent guard)."""
    q, k, v = _qkv(1, 2, 24, 24, 8, torch.float32, 6)
    index, count = _lists(1, 2, 24, 24, 8, 2, torch.int64, 6)

    def loss(a, b, c):
        return (torch.ops.spore.block_sparse_attention(a, b, c, index, count, 8) ** 2).sum()

    want = [t.detach().requires_grad_() for t in (q, k, v)]
    got = [t.detach().requires_grad_() for t in (q, k, v)]
    loss(*want).backward()
    torch.compile(loss, backend="aot_eager", fullgraph=True)(*got).backward()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.grad, w.grad)


def _bad_cases():
    q, k, v = _qkv(1, 2, 10, 12, 4, torch.float32, 7)
    index, count = _lists(1, 2, 10, 12, 4, 2, torch.int64, 7, garbage=False)
    count.fill_(2)
    good = (q, k, v, index, count, 4)

    def with_(**changes):
        names = ("q", "k", "v", "index", "count", "bs")
        return tuple(changes.get(n, a) for n, a in zip(names, good, strict=True))

    dup = index.clone()
    dup[0, 1, 2, 1] = dup[0, 1, 2, 0]
    return [
        (with_(q=q.long()), TypeError, "q must be a floating-point tensor"),
        (with_(k=k.double()), TypeError, "one dtype"),
        (with_(q=q[0]), ValueError, "must be 4-D"),
        (with_(v=v[:, :, :5]), ValueError, "k and v must have shape"),
        (with_(k=k[:, :1], v=v[:, :1]), ValueError, "expand grouped heads"),
        (with_(q=q[..., :2]), ValueError, "with q's B, H and D"),
        (with_(index=index.float()), TypeError, "kv_block_index must be int32 or int64"),
        (with_(count=count.int()), TypeError, "kv_block_count must have kv_block_index's dtype"),
        (with_(index=index[:, :, :2]), ValueError, r"ceil\(Sq / block_size\) = 3"),
        (with_(index=index[:, :1]), ValueError, r"kv_block_index must have shape \(1, 2, 3, M\)"),
        (with_(count=count[..., :2]), ValueError, r"kv_block_count must have shape \(1, 2, 3\)"),
        (with_(count=count + 1), ValueError, "kv_block_count must lie in 0..2"),
        (with_(count=count - 3), ValueError, "kv_block_count must lie in 0..2"),
        (with_(index=index.masked_fill(index == 0, 3)), ValueError, "ids must lie in 0..2"),
        (with_(index=index.masked_fill(index == 0, -1)), ValueError, "ids must lie in 0..2"),
        (with_(index=dup), ValueError, r"distinct; query block \(0, 1, 2\)"),
        (with_(bs=0), ValueError, "block_size must be a positive int"),
    ]


@pytest.mark.parametrize(("args", "error", "message"), _bad_cases())
def test_bad_input_is_a_clear_error(args, error, message) -> None:
    with pytest.raises(error, match=message):
        torch.ops.spore.block_sparse_attention(*args)
    with pytest.raises(error, match=message):
        op.reference(*args)


def test_bad_scale_and_bad_lists_for_dense_mask_are_clear_errors() -> None:
    q, k, v = _qkv(1, 1, 8, 8, 4, torch.float32, 8)
    index, count = _lists(1, 1, 8, 8, 4, 2, torch.int64, 8)
    with pytest.raises(ValueError, match="scale must be finite"):
        torch.ops.spore.block_sparse_attention(q, k, v, index, count, 4, scale=float("inf"))
    with pytest.raises(ValueError, match=r"ids must lie in 0\.\.0"):
        op.dense_mask(index, count.fill_(2), 4, 8, 3)


@settings(max_examples=60, deadline=None)
@given(
    sq=st.integers(1, 80),
    skv=st.integers(1, 80),
    bs=st.sampled_from([1, 4, 16, 17, 64]),
    d=st.sampled_from([1, 8, 13, 16, 33, 64]),
    dtype=st.sampled_from(list(TOL)),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_the_reference(sq, skv, bs, d, dtype, index_dtype, seed) -> None:
    """Widths across the kernel's tiles (4 rows, 16 columns) and ragged last blocks."""
    q, k, v = _qkv(2, 2, sq, skv, d, dtype, seed)
    index, count = _lists(2, 2, sq, skv, bs, op.blocks(skv, bs), index_dtype, seed)
    args = (q, k, v, index, count, bs)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    out = op.cpu(*args)
    expected = op.reference(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize(("sq", "skv", "bs"), [(100, 100, 10**6), (50, 100, 70), (100, 40, 4096)])
def test_a_block_longer_than_the_sequences_costs_no_more_than_one_as_long(sq, skv, bs) -> None:
    """Work space was sized by block_size: 16384 over 100 tokens took 2.3 GB and 10**6 ran out
    of memory. A block longer than both sequences is one block each way, as one as long."""
    q, k, v = _qkv(1, 2, sq, skv, 16, torch.float32, 4)
    index, count = _lists(1, 2, sq, skv, bs, op.blocks(skv, bs), torch.int64, 4, garbage=False)
    args = (q, k, v, index, count, bs)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    expected = _oracle(*args)
    _close(torch.ops.spore.block_sparse_attention(*args), expected, torch.float32)
    _close(op.reference(*args), expected, torch.float32)


def test_bf16_output_is_the_fp32_result_rounded_once() -> None:
    """Within half a bf16 step (one rounding) of the fp32 result, plus fp32 summation noise."""
    q, k, v = _qkv(1, 4, 128, 128, 64, torch.bfloat16, 9)
    index, count = _lists(1, 4, 128, 128, 32, 3, torch.int64, 9, garbage=False)
    out = op.cpu(q, k, v, index, count, 32).float()
    exact = op.reference(q.float(), k.float(), v.float(), index, count, 32)
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    assert bool(((out - exact).abs() <= step / 2 + 1e-6).all())


_PATHS = {"packed": 24, "direct": 8}  # query rows: packed KV blocks, or k and v read directly


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_a_nan_reaches_exactly_the_rows_that_attend_to_it(dtype, path) -> None:
    """As in the reference; dense SDPA under the mask is no oracle here: its CPU kernel adds
    the mask, so a NaN key turns every row of its head NaN, listed or not."""
    sq = _PATHS[path]
    q, k, v = _qkv(1, 2, sq, 24, 8, dtype, 16)
    index, count = _lists(1, 2, sq, 24, 8, 2, torch.int64, 16, garbage=False)
    count.fill_(2)
    q[0, 0, 3, 1] = float("nan")  # one query row
    k[0, 1, 20, 0] = float("nan")  # one key of KV block 2
    args = (q, k, v, index, count, 8)
    got = op.cpu(*args).isnan().any(-1)
    expected = torch.zeros(1, 2, sq, dtype=torch.bool)
    expected[0, 0, 3] = True
    for i in range(sq // 8):
        expected[0, 1, i * 8 : (i + 1) * 8] = 2 in index[0, 1, i].tolist()
    assert torch.equal(got, expected)
    assert torch.equal(op.reference(*args).isnan().any(-1), expected)


@pytest.mark.parametrize("path", list(_PATHS))
def test_a_score_past_float32_makes_its_row_nan_as_the_reference(path) -> None:
    """q.k overflowing to +inf makes its row's softmax NaN (inf - inf), as torch's: the
    kernel made 2^(inf - inf) a 0, a row of zeros."""
    sq = _PATHS[path]
    q, k, v = _qkv(1, 1, sq, 8, 8, torch.float32, 3)
    q[0, 0, 2] = 1e30
    k[0, 0, 5] = 1e30
    index, count = _lists(1, 1, sq, 8, 4, 2, torch.int64, 3, garbage=False)
    count.fill_(2)
    args = (q, k, v, index, count, 4)
    got, want = op.cpu(*args), op.reference(*args)
    assert bool(want[0, 0, 2].isnan().all())
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_nan_in_a_block_no_row_lists_reaches_no_row_nor_gradient(dtype) -> None:
    """A query block listing fewer blocks than the lists' width leaves slots unlisted; a NaN
    (or inf) in k or v of a block that only such slots name reaches no output and no
    gradient: the kernel's forward, the reference's (float64 runs it), and autograd's
    backward (through the reference). The reference used to read block 0 in an unlisted slot
    and multiply its v by a zero weight: 0 * NaN."""
    q, k, v = _qkv(1, 2, 8, 16, 4, dtype, 21)  # 2 query blocks, 4 KV blocks
    index = torch.tensor([[[1, 9], [3, 9]], [[2, 1], [1, 9]]]).unsqueeze(0)
    count = torch.tensor([[[1, 1], [2, 1]]])  # head 0 lists blocks 1 and 3, head 1 blocks 1, 2
    k[0, :, 0, 1] = float("nan")  # KV block 0 (rows 0-3), listed by no query block
    v[0, :, 1, 2] = float("inf")
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.ops.spore.block_sparse_attention(*args, index, count, 4)
    assert torch.isfinite(out).all()
    assert torch.isfinite(op.reference(q, k, v, index, count, 4)).all()
    out.sum().backward()
    for t in args:
        assert torch.isfinite(t.grad).all()
    _close(
        out.detach(), _oracle(q, k.nan_to_num(), v.nan_to_num(posinf=0.0), index, count, 4), dtype
    )


@pytest.mark.parametrize(("b", "h"), [(0, 2), (2, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_no_batch_or_no_heads(b, h, dtype) -> None:
    """An empty batch or no heads: an empty result and gradient on every path (the
    reference divided by zero)."""
    q, k, v = (t.requires_grad_() for t in _qkv(b, h, 8, 8, 4, dtype, 22))
    index, count = _lists(b, h, 8, 8, 4, 2, torch.int64, 22)
    out = torch.ops.spore.block_sparse_attention(q, k, v, index, count, 4)
    assert out.shape == q.shape
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_inputs_the_kernel_does_not_take_run_the_reference() -> None:
    q, k, v = _qkv(1, 2, 16, 16, 8, torch.float32, 10)
    index, count = _lists(1, 2, 16, 16, 4, 2, torch.int64, 10)
    strided = k.transpose(2, 3).contiguous().transpose(2, 3)
    assert not strided.is_contiguous()
    for args in (
        (q, strided, v, index, count, 4),
        (q.double(), k.double(), v.double(), index, count, 4),
    ):
        assert dispatch.explain("block_sparse_attention", *args).chosen == "reference"
        _close(torch.ops.spore.block_sparse_attention(*args), _oracle(*args), args[0].dtype)


def test_the_reference_takes_any_layout_of_its_inputs() -> None:
    """k and v as (B, S, H, D) projections transposed to (B, H, S, D) (the usual layout) and
    lists transposed over B and H: the reference merged B and H with ``view``, which such
    strides refuse (a RuntimeError telling the user to use reshape)."""
    b, h, s, d = 2, 3, 16, 8
    q, k, v = (
        t.view(b, h, s, d).transpose(1, 2).contiguous().transpose(1, 2)
        for t in _qkv(b, h, s, s, d, torch.float32, 12)
    )
    assert not k.is_contiguous()
    index, count = _lists(b, h, s, s, 4, 2, torch.int64, 12)
    index = index.transpose(0, 1).contiguous().transpose(0, 1)
    count = count.transpose(0, 1).contiguous().transpose(0, 1)
    for args in ((q, k, v, index, count, 4), (q.double(), k.double(), v.double(), index, count, 4)):
        assert dispatch.explain("block_sparse_attention", *args).chosen == "reference"
        _close(torch.ops.spore.block_sparse_attention(*args), _oracle(*args), args[0].dtype)


def test_the_kernel_takes_non_contiguous_block_lists() -> None:
    q, k, v = _qkv(2, 2, 16, 16, 8, torch.float32, 10)
    index, count = _lists(2, 2, 16, 16, 4, 2, torch.int64, 10)
    index = torch.cat([index, torch.zeros_like(index)], -1)[..., :2]
    count = count.transpose(0, 1).contiguous().transpose(0, 1)
    assert not index.is_contiguous()
    assert not count.is_contiguous()
    args = (q, k, v, index, count, 4)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    _close(torch.ops.spore.block_sparse_attention(*args), _oracle(*args), torch.float32)


def _c_args(dtype=torch.float32, index_dtype=torch.int64, sq=10):
    q, k, v = _qkv(1, 2, sq, 12, 8, dtype, 11)
    index, count = _lists(1, 2, sq, 12, 4, 3, index_dtype, 11, garbage=False)
    return q, k, v, index.contiguous(), count, torch.empty_like(q)


def _call(fn, q, k, v, index, count, out, *, sizes=None, code=None, n=2):
    """The library on these tensors (None: a null pointer), as ``spore_kernels`` would call it."""
    ptrs = [t if t is None else t.data_ptr() for t in (q, k, v, index, count, out)]
    shape = sizes or (2, q.shape[2], k.shape[2], q.shape[3], index.shape[-1], 4)
    wide = int(index is None or index.dtype == torch.int64)
    code = _lib.dtype_code(out) if code is None else code
    return fn(*ptrs, *shape, 0.5, wide, code, n)


@pytest.mark.parametrize("isa", _lib.available())
def test_every_installed_build_computes_the_same(isa) -> None:
    fn = _lib.function("spore_block_sparse_attention", op._ARGS, _lib.load(isa))
    # 10 query rows pack the listed blocks, 5 read k and v directly
    for dtype, index_dtype, sq in itertools.product(TOL, op.INDEX_DTYPES, (10, 5)):
        q, k, v, index, count, out = _c_args(dtype, index_dtype, sq)
        assert _call(fn, q, k, v, index, count, out) == 0
        expected = op.reference(q, k, v, index, count, 4, scale=0.5)
        torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_the_library_refuses_what_would_read_out_of_bounds() -> None:
    """Status 1 (bad argument) or 2 (dtype), and the output left untouched."""
    fn = _lib.function("spore_block_sparse_attention", op._ARGS)
    q, k, v, index, count, out = _c_args()
    sizes = (2, 10, 12, 8, 3, 4)
    out.fill_(7.0)
    too_many = count.clone()
    too_many[0, 1, 2] = 4
    negative = count.clone()
    negative[0, 0, 0] = -1
    past = index.clone()
    past[0, 1, 1, 0] = 3  # 12 keys / 4 = blocks 0..2
    below = index.clone()
    below[0, 0, 2, 0] = -1
    count.fill_(3)
    for bad in (
        dict(count=too_many),
        dict(count=negative),
        dict(index=past),
        dict(index=below),
        dict(q=None),
        dict(k=None),
        dict(count=None),
        dict(index=None),
        dict(sizes=(2, 10, 12, 8, 3, 0)),
        dict(sizes=(2, -1, 12, 8, 3, 4)),
        dict(sizes=(2, 10, 12, 8, 3, 4), n=0),
    ):
        args = dict(q=q, k=k, v=v, index=index, count=count, out=out) | bad
        extra = {key: args.pop(key) for key in ("sizes", "n") if key in args}
        assert _call(fn, *args.values(), **({"sizes": sizes} | extra)) == 1, bad
    assert _call(fn, q, k, v, index, count, out, sizes=sizes, code=9) == 2
    assert bool((out == 7.0).all())
    with pytest.raises(_lib.KernelError, match="bad argument"):
        _lib.call(
            "spore_block_sparse_attention", op._ARGS, *[0] * 6, 1, 1, 1, 1, 1, 0, 1.0, 0, 0, 1
        )
    assert _call(fn, q, k, v, index, count, out, sizes=sizes) == 0
    torch.testing.assert_close(out, op.reference(q, k, v, index, count, 4, scale=0.5))


def test_the_kernel_checks_the_lists_before_calling_the_library() -> None:
    q, k, v, index, count, _ = _c_args()
    count.fill_(3)
    index[0, 0, 0, 0] = 99
    with pytest.raises(ValueError, match=r"ids must lie in 0\.\.2"):
        op.cpu(q, k, v, index, count, 4)


def _flex():
    """The CUDA path's module, imported in the test: importing ``spore_kernels.cuda`` imports
    triton, which test_triton.py must import first (it selects the interpreter)."""
    from spore_kernels.cuda import block_sparse_attention as flex

    return flex


def test_the_flex_block_mask_holds_the_lists_as_full_blocks() -> None:
    flex = _flex()
    sq, skv, bs = 40, 37, 16
    index, count = _lists(2, 2, sq, skv, bs, 2, torch.int32, 12)
    mask = flex.block_mask(index, count, bs, sq, skv)
    table = op.dense_block_table(index, count, op.blocks(skv, bs))
    assert torch.equal(mask.to_dense().bool(), table)
    assert torch.equal(mask.full_kv_num_blocks, count)
    assert int(mask.kv_num_blocks.sum()) == 0  # no partial blocks
    assert mask.seq_lengths == (sq, skv)
    # flex_attention's eager path ignores the block lists and applies the mask_mod everywhere
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = _qkv(2, 2, sq, skv, 16, torch.float32, 12)
    with pytest.warns(UserWarning, match="torch.compile"):
        out = flex_attention(q, k, v, block_mask=mask)
    _close(out, _oracle(q, k, v, index, count, bs), torch.float32)


def test_compiled_flex_attention_visits_the_listed_blocks() -> None:
    """Compiled on CPU (Inductor's C++ flex template) the block lists decide which blocks run,
    as in the Triton kernel on CUDA: equal to dense SDPA under the mask, ragged Skv, empty
    query blocks zero."""
    flex = _flex()
    sq, skv, bs = 256, 200, 128
    q, k, v = _qkv(1, 2, sq, skv, 16, torch.float32, 13)
    index, count = _lists(1, 2, sq, skv, bs, 1, torch.int64, 13, garbage=False)
    count[0, 0, 0] = 0
    count[0, 1] = 1
    mask = flex.block_mask(index, count, bs, sq, skv)
    out = flex._compiled()(q, k, v, block_mask=mask)
    _close(out, _oracle(q, k, v, index, count, bs), torch.float32)
    assert torch.equal(out[0, 0, :bs], torch.zeros(bs, 16))


def test_the_flex_path_takes_only_what_its_tiles_fit() -> None:
    flex = _flex()
    q, k, v = _qkv(1, 1, 32, 32, 16, torch.float32, 14)
    index, count = _lists(1, 1, 32, 32, 16, 2, torch.int64, 14)
    assert not flex.supports(q, k, v, index, count, 16)  # CPU tensors: the C++ kernel's
    assert [flex._tile(b) for b in (16, 48, 64, 128, 256, 384)] == [16, 16, 64, 128, 128, 128]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_cuda_runs_flex_attention_and_matches_dense_sdpa(dtype) -> None:
    q, k, v = (t.cuda() for t in _qkv(2, 3, 300, 260, 64, dtype, 15))
    index, count = (t.cuda() for t in _lists(2, 3, 300, 260, 64, 3, torch.int32, 15))
    args = (q, k, v, index, count, 64)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    out = torch.ops.spore.block_sparse_attention(*args)
    expected = _oracle(*(t.cpu() for t in args[:5]), 64)
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]  # flash-style
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "sizes",
    [
        (2, 2**40, 12, 8, 1, 2**40),  # 2^40 query rows a block: 2^43 floats of scratch
        (2, 2**40, 2**40, 2**30, 1, 2**40),  # rows x keys and keys x d pass int64
        (2, 2**62, 2**62, 8, 1, 2**63 - 1),  # keys x d pass int64
        (2, 10, 2**63 - 1, 8, 1, 2**63 - 1),  # a block's keys padded past int64
        (2, 5, 2**62, 8, 1, 2**62),  # few rows (read directly) by a block's keys pass int64
    ],
)
def test_scratch_beyond_memory_is_an_error_not_an_abort(sizes) -> None:
    """Sizes stated to the library whose scratch cannot be had (the op caps a block at the
    longer sequence, and the scratch at the block's rows and keys): the library says so with
    status 3 (std::bad_alloc inside OpenMP aborted the process before; a size passing int64 is
    refused, not wrapped), the output left untouched and nothing read."""
    fn = _lib.function("spore_block_sparse_attention", op._ARGS)
    q, k, v, _, _, out = _c_args()
    index, count = torch.zeros(2, 1, 1, dtype=torch.int64), torch.ones(2, 1, dtype=torch.int64)
    out.fill_(7.0)
    assert _call(fn, q, k, v, index, count, out, sizes=sizes) == 3
    assert _lib.STATUS[3] == "out of memory for scratch"
    assert bool((out == 7.0).all())


def test_heads_packed_in_groups_list_their_own_blocks() -> None:
    """H=3 over 8 blocks of 4096 keys (D=64) packs two heads at a time, so the third head's
    group reuses the first's buffer: each head must read its own listed blocks, never a slot
    another group packed (only listed blocks are packed, and the buffer is not cleared)."""
    q, k, v = _qkv(1, 3, 12, 32768, 64, torch.float32, 12)  # 12 rows: the packed path
    index = torch.tensor([[[[0, 5]], [[3, 7]], [[6, 1]]]], dtype=torch.int64)
    count = torch.tensor([[[2], [1], [2]]], dtype=torch.int64)
    args = (q, k, v, index, count, 4096)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    _close(torch.ops.spore.block_sparse_attention(*args), _oracle(*args), torch.float32)


@pytest.mark.parametrize("d", [1, 13, 21, 40])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
def test_the_direct_path_takes_any_head_size_and_short_blocks(d, dtype) -> None:
    """Sq <= 8 reads k and v directly, four keys at a time: head sizes with and without a
    whole vector and a tail, and KV blocks of 5 keys with a last one of 3 (fewer than four)."""
    q, k, v = _qkv(1, 2, 5, 23, d, dtype, 30 + d)
    index, count = _lists(1, 2, 5, 23, 5, op.blocks(23, 5), torch.int64, 30 + d)
    args = (q, k, v, index, count, 5)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    _close(torch.ops.spore.block_sparse_attention(*args), _oracle(*args), dtype)


@pytest.mark.parametrize(
    ("sq", "skv", "bs"),
    [(1, 4096, 4096), (7, 1000, 2048), (3, 32, 64), (9, 4096, 4096), (12, 32, 64), (16, 8, 4)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_few_query_rows_over_long_blocks(sq, skv, bs, dtype) -> None:
    """Decoding shapes (Sq <= 8 reads k and v directly, no packed copy; Sq >= 9 packs the
    listed blocks), where a block's scratch is sized by the rows and keys there are,
    fewer than the block holds: the padded rows and keys stay out of the result, and keys a
    whole number of vectors (4096, 32) run the packed path's vector loop over the block."""
    q, k, v = _qkv(1, 2, sq, skv, 16, dtype, 5)
    index, count = _lists(1, 2, sq, skv, bs, op.blocks(skv, bs), torch.int64, 5, garbage=False)
    args = (q, k, v, index, count, bs)
    assert dispatch.explain("block_sparse_attention", *args).chosen == "kernels"
    _close(torch.ops.spore.block_sparse_attention(*args), _oracle(*args), dtype)


def test_the_reference_output_is_contiguous_as_the_fake_says() -> None:
    """Sq not a multiple of block_size, float64 (the reference runs): its output was a view
    of the padded rows, with other strides than the fake's contiguous ones."""
    from torch._inductor.utils import fresh_cache

    q, k, v = _qkv(1, 2, 10, 12, 4, torch.float64, 11)
    index, count = _lists(1, 2, 10, 12, 4, 2, torch.int64, 11)
    out = torch.ops.spore.block_sparse_attention(q, k, v, index, count, 4)
    assert out.is_contiguous()

    def fn(a, b, c):
        return torch.ops.spore.block_sparse_attention(a, b, c, index, count, 4) * 2 + 1

    torch._dynamo.reset()
    with fresh_cache():
        torch.testing.assert_close(torch.compile(fn, fullgraph=True)(q, k, v), out * 2 + 1)
