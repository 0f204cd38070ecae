"""Sparse video attention: the reorder, the block choice, and the result against dense attention
masked to the same blocks (the oracle), per batch element, with text before or after."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lite_boost import backends, numeric_args
from lite_boost.sparse import (
    _pool,
    keep_count,
    reorder,
    select_blocks,
    sparse_attention,
    tile_shape,
)


def _qkv(latent_shape, text_len=0, batch=2, heads=2, dim=16, smooth=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = math.prod(latent_shape) + text_len
    if not smooth:
        return [torch.randn(batch, heads, s, dim, generator=g) for _ in range(3)]
    # features varying slowly over the (f, h, w) grid and a peaked softmax, as in video models
    f, h, w = latent_shape
    grid = (
        torch.stack(
            torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1
        )
        .reshape(-1, 3)
        .float()
    )
    freqs = torch.randn(3, dim, generator=g) * 0.2
    base = torch.cat([torch.sin(grid @ freqs), torch.randn(text_len, dim, generator=g)])
    out = []
    for _ in range(3):
        noise = torch.randn(batch, heads, s, dim, generator=g) * 0.05
        out.append(base * 3 + noise)
    return out


def _oracle(q, k, v, latent_shape, text_len, sparsity, block_size, text_first):
    """Dense SDPA over the reordered tokens, masked to the blocks select_blocks keeps."""
    video = math.prod(latent_shape)
    start = text_len if text_first else 0
    order = torch.cat(
        [
            torch.arange(start),
            reorder(latent_shape, block_size) + start,
            torch.arange(start + video, q.shape[2]),
        ]
    )
    qr, kr, vr = (t[:, :, order] for t in (q, k, v))
    index, count = select_blocks(
        qr,
        kr,
        video_len=video,
        first_frame_len=latent_shape[1] * latent_shape[2],
        text_first=text_first,
        sparsity=sparsity,
        block_size=block_size,
    )
    s = q.shape[2]
    blocks = -(-s // block_size)
    keep = torch.zeros(*index.shape[:2], blocks, blocks, dtype=torch.bool)
    ranks = torch.arange(index.shape[-1])
    keep.scatter_(-1, index, ranks < count[..., None])
    tok = torch.arange(s) // block_size
    mask = keep[:, :, tok][:, :, :, tok]
    out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    restored = torch.empty_like(out)
    restored[:, :, order] = out
    return restored, count


def test_tiles_are_compact_and_the_reorder_is_a_permutation():
    perm = reorder((2, 16, 16), 64)
    assert sorted(perm.tolist()) == list(range(512))
    assert tile_shape(16, 16, 64) == (8, 8)
    for block in perm.view(-1, 64):
        f, r, c = block // 256, block % 256 // 16, block % 16
        assert f.unique().numel() == 1  # one frame
        assert r.max() - r.min() == 7  # an 8 x 8 tile
        assert c.max() - c.min() == 7
    ragged = reorder((3, 10, 13), 128)  # frames not a multiple of the 8 x 16 tile
    assert sorted(ragged.tolist()) == list(range(390))


def test_sparsity_zero_is_dense_attention_exactly():
    q, k, v = _qkv((2, 4, 6), text_len=5)
    got = sparse_attention(q, k, v, latent_shape=(2, 4, 6), text_len=5, sparsity=0.0)
    assert torch.equal(got, backends.attention(q, k, v))


@pytest.mark.parametrize("text_first", [False, True])
@pytest.mark.parametrize(
    ("latent_shape", "text_len", "block_size", "sparsity"),
    [((3, 8, 8), 0, 16, 0.75), ((2, 5, 7), 9, 8, 0.5), ((4, 6, 6), 20, 32, 0.6)],
)
def test_equals_dense_attention_masked_to_the_kept_blocks(
    latent_shape, text_len, block_size, sparsity, text_first
):
    q, k, v = _qkv(latent_shape, text_len)
    got = sparse_attention(
        q, k, v, latent_shape=latent_shape, text_len=text_len, sparsity=sparsity,
        block_size=block_size, text_first=text_first,
    )  # fmt: skip
    want, count = _oracle(q, k, v, latent_shape, text_len, sparsity, block_size, text_first)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    blocks = count.shape[-1]
    assert count.min() >= math.ceil((1 - sparsity) * blocks)
    assert count.float().mean() < blocks  # some blocks were skipped


def test_the_kept_count_is_the_decimal_ceiling_not_one_more():
    """ceil((1 - sparsity) * blocks) as the decimals say: float error in the product (e.g.
    (1 - 0.7) * 10 = 3.0000000000000004) must not keep one more block."""
    for blocks in range(1, 41):
        for tenths in range(10):
            sparsity = tenths / 10
            exact = (1 - Fraction(str(sparsity))) * blocks
            assert keep_count(sparsity, blocks) == max(1, math.ceil(exact)), (sparsity, blocks)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 80, 8, generator=g)
    _, count = select_blocks(
        q, k, video_len=80, first_frame_len=0, text_first=False, sparsity=0.7, block_size=8
    )
    assert count.tolist() == [[[3] * 10]]


def test_each_batch_element_chooses_its_own_blocks():
    q, k, v = _qkv((3, 8, 8), batch=2)
    q2, k2, v2 = _qkv((3, 8, 8), batch=1, seed=5)
    q[1:], k[1:], v[1:] = q2, k2, v2
    opts = {"latent_shape": (3, 8, 8), "sparsity": 0.75, "block_size": 16}
    both = sparse_attention(q, k, v, **opts)
    torch.testing.assert_close(both[1:], sparse_attention(q2, k2, v2, **opts))
    torch.testing.assert_close(both[:1], sparse_attention(q[:1], k[:1], v[:1], **opts))


def test_text_blocks_and_the_first_frame_are_always_kept():
    latent, text = (4, 4, 8), 16  # 32 tokens a frame, blocks of 16: frame 0 is blocks 0-1
    q, k, _ = _qkv(latent, text)
    order = torch.cat([reorder(latent, 16), torch.arange(128, 144)])
    index, count = select_blocks(
        q[:, :, order], k[:, :, order], video_len=128, first_frame_len=32,
        text_first=False, sparsity=0.9, block_size=16,
    )  # fmt: skip
    blocks = 9
    for b in range(2):
        for h in range(2):
            for i in range(blocks):
                kept = set(index[b, h, i, : count[b, h, i]].tolist())
                assert {0, 1, 8, i} <= kept
    assert (count[..., 8] == blocks).all()  # the text queries attend everywhere


def test_a_nan_token_does_not_push_out_its_block_s_forced_blocks():
    """argsort ranks NaN above the forced blocks' +inf: one NaN query token made its block
    list its NaN-scored key blocks first, and the block's other, finite rows lost their own
    block and the first frame. They attend as promised; only the NaN row is NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 8, generator=g) for _ in range(3))
    q[0, 0, 40, 0] = float("nan")  # block 2 of 4 (one frame a block)
    index, count = select_blocks(
        q, k, video_len=64, first_frame_len=16, text_first=False, sparsity=0.5, block_size=16
    )
    assert set(index[0, 0, 2, : count[0, 0, 2]].tolist()) == {0, 2}
    out = sparse_attention(q, k, v, latent_shape=(4, 4, 4), sparsity=0.5, block_size=16)
    mask = torch.zeros(64, 64, dtype=torch.bool)
    mask[32:48, 0:16] = mask[32:48, 32:48] = True
    rows = [r for r in range(32, 48) if r != 40]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0, 0, rows]
    torch.testing.assert_close(out[0, 0, rows], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparsity", [0.5, 0.75])
def test_structured_inputs_stay_close_to_dense(sparsity):
    latent = (4, 16, 16)
    q, k, v = _qkv(latent, smooth=True, batch=1)
    got = sparse_attention(q, k, v, latent_shape=latent, sparsity=sparsity, block_size=64)
    dense = backends.attention(q, k, v)
    cosine = F.cosine_similarity(got.flatten(), dense.flatten(), dim=0)
    assert cosine >= 0.99, cosine


def test_grouped_kv_heads_are_expanded():
    q, k, v = _qkv((2, 4, 4), heads=4)
    k2, v2 = k[:, :2].contiguous(), v[:, :2].contiguous()
    opts = {"latent_shape": (2, 4, 4), "sparsity": 0.5, "block_size": 8}
    got = sparse_attention(q, k2, v2, **opts)
    want = sparse_attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), **opts)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"latent_shape": (2, 4, 4), "sparsity": 1.0}, "sparsity must be in"),
        ({"latent_shape": (2, 4, 4), "sparsity": "0.5"}, "sparsity must be a number.*str '0.5'"),
        ({"latent_shape": (2, 4, 4), "sparsity": True}, "sparsity must be a number.*bool"),
        ({"latent_shape": (2, 4, 5), "sparsity": 0.5}, "must hold 40 video tokens"),
        ({"latent_shape": (2, 4), "sparsity": 0.5}, "latent_shape must be"),
        ({"latent_shape": (2, 4, 4), "sparsity": 0.5, "block_size": 0}, "block_size must be"),
        ({"latent_shape": (2, 4, 4), "sparsity": 0.5, "block_size": 8.0}, r"an int >= 1, got 8\.0"),
        ({"latent_shape": (2.5, 4, 4), "sparsity": 0.5}, r"three ints .* got \(2\.5, 4, 4\)"),
        ({"latent_shape": (True, 4, 4), "sparsity": 0.5}, "latent_shape must be three ints"),
        ({"latent_shape": {2, 4, 3}, "sparsity": 0.5}, "latent_shape must be three ints"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    q, k, v = _qkv((2, 4, 4))
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, k, v: (q[0], k[0], v[0]), r"\(batch, heads, seq, head_dim\)"),
        (lambda q, k, v: (q, k[:, :3], v[:, :3]), "q's 4 heads must be a multiple of k/v's 3"),
        (lambda q, k, v: (q, k, v[:, :, :10]), "must match each other"),
        (lambda q, k, v: (q, k[..., :4], v[..., :4]), "in batch and head_dim"),
        (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), "in batch and head_dim"),
    ],
    ids=["3-d", "heads", "v-tokens", "head-dim", "batch"],
)
def test_mismatched_q_k_v_are_named(change, match):
    """Each used to fail deep inside (a broadcast, an index or a matmul) or not at all."""
    q, k, v = change(*_qkv((2, 4, 4), heads=4))
    with pytest.raises(ValueError, match=match):
        sparse_attention(q, k, v, latent_shape=(2, 4, 4), sparsity=0.5, block_size=8)


def test_numpy_float_sparsities_keep_what_the_same_python_float_keeps():
    """numpy's float16 sparsity made the kept count NaN ("cannot convert float NaN to
    integer"), and a float32 0.7 (0.699999988) kept 4 of 10 blocks where the float 0.7 keeps 3:
    every float width keeps what the decimal it was written as keeps."""
    blocks_tried = (1, 3, 7, 10, 64, 100, 256, 1000)
    for thousandths in range(1000):
        sparsity = thousandths / 1000
        want = [keep_count(sparsity, blocks) for blocks in blocks_tried]
        for dtype in (np.float16, np.float32, np.float64):
            got = [keep_count(dtype(sparsity), blocks) for blocks in blocks_tried]
            assert got == want, (dtype, sparsity)
    assert keep_count(0.7, 10) == keep_count(np.float32(0.7), 10) == 3
    assert keep_count(0.699999988079071, 10) == 4  # a Python float counts as its value
    q, k, v = _qkv((2, 4, 4))
    opts = {"latent_shape": (2, 4, 4), "block_size": 4}
    want = sparse_attention(q, k, v, sparsity=0.7, **opts)
    for sparsity in (np.float16(0.7), np.float32(0.7), np.float64(0.7)):
        got = sparse_attention(q, k, v, sparsity=sparsity, **opts)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_negative_text_len_is_refused():
    q, k, v = _qkv((2, 4, 4))
    with pytest.raises(ValueError, match="text_len must be an int >= 0, got -8"):
        sparse_attention(q, k, v, latent_shape=(2, 4, 5), text_len=-8, sparsity=0.5)  # 40 - 8


def test_numpy_and_tensor_integers_are_taken_as_sizes():
    import numpy as np  # diffusers' dependency

    q, k, v = _qkv((2, 4, 4), text_len=5)
    opts = {"latent_shape": (2, 4, 4), "sparsity": 0.5}
    want = sparse_attention(q, k, v, text_len=5, block_size=8, **opts)
    got = sparse_attention(q, k, v, text_len=np.int64(5), block_size=torch.tensor(8), **opts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _tool(name):
    path = Path(__file__).parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_pool_to_their_mean_without_an_fp32_copy_of_all_heads(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 100, 16, generator=g).to(dtype)  # blocks of 32: the last holds 4
    with _tool("block_choice_cost").LargestAlloc() as seen:
        got = _pool(x, 32)
    want = torch.stack([c.double().mean(2) for c in x.split(32, dim=2)], 2)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    assert got.dtype == torch.float32
    fp32_copy = x.numel() * 4
    assert seen.largest < fp32_copy / 4  # two of the eight heads' worth at most


def test_a_block_longer_than_the_sequence_is_its_one_block():
    """Pooling padded every row to ``block_size``: 2**22 took 1 GB for 24 tokens, and 10**20
    failed with an overflow in ``torch.zeros``."""
    q, k, v = _qkv((2, 3, 4), text_len=3)
    one_block = sparse_attention(
        q, k, v, latent_shape=(2, 3, 4), text_len=3, sparsity=0.5, block_size=27
    )
    for huge in (2**22, 10**20):
        with _tool("block_choice_cost").LargestAlloc() as seen:
            got = sparse_attention(
                q, k, v, latent_shape=(2, 3, 4), text_len=3, sparsity=0.5, block_size=huge
            )
        torch.testing.assert_close(got, one_block, rtol=0, atol=0)
        assert seen.largest < 2**20
    index, count = select_blocks(
        q, k, video_len=24, first_frame_len=12, text_first=False, sparsity=0.5, block_size=10**20
    )
    assert index.shape == (2, 2, 1, 1)
    assert count.tolist() == [[[1], [1]], [[1], [1]]]


@pytest.mark.parametrize("module", ["lite_boost.rope3d", "lite_boost.boosters"])
def test_rope_and_boosters_check_numbers_without_importing_sparse_attention(module):
    """The integer-argument helpers lived in ``sparse``: importing RoPE or the boosters pulled
    in sparse attention and defined the attention op."""
    loaded = "{'lite_boost.sparse', 'lite_boost.backends'} & set(sys.modules)"
    code = f"import sys, {module}; print(sorted({loaded}))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_numeric_args_take_exact_integers_in_order():
    assert numeric_args.as_int(np.int64(3)) == numeric_args.as_int(torch.tensor(3)) == 3
    assert numeric_args.as_int(True) is numeric_args.as_int(3.0) is None
    assert numeric_args.as_ints([1, np.int32(2), 3]) == (1, 2, 3)
    assert numeric_args.as_ints({1, 2, 3}) is numeric_args.as_ints(iter([1])) is None
    assert numeric_args.is_number(np.float32(0.5))
    assert not numeric_args.is_number(False)
