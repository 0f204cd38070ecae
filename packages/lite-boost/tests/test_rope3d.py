"""Cached 3-D RoPE against diffusers' WanRotaryPosEmbed + its attention processor's apply, and
against a float64 complex rotation; the cache; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lite_boost import rope3d

wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")

GRIDS = [((2, 3, 4), 12), ((3, 5, 7), 128), ((1, 1, 9), 20), ((4, 2, 3), 64)]


@pytest.fixture(autouse=True)
def _fresh_cache():
    rope3d.cache_clear()
    yield
    rope3d.cache_clear()


def _diffusers_rope_and_query(grid, head_dim, heads=2, batch=2):
    """diffusers' own path: WanRotaryPosEmbed's tables, applied by WanAttnProcessor to the query
    (captured where the processor hands it to attention). Returns (q before rope, q after)."""
    f, h, w = grid
    rope = wan.WanRotaryPosEmbed(head_dim, (1, 1, 1), max_seq_len=32)
    rotary = rope(torch.zeros(1, 1, f, h, w))
    attn = wan.WanAttention(
        dim=heads * head_dim, heads=heads, dim_head=head_dim, processor=wan.WanAttnProcessor()
    )
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(batch, f * h * w, heads * head_dim, generator=g)
    seen = {}

    def capture(query, key, value, **kwargs):
        seen["q"] = query
        return query

    patch = pytest.MonkeyPatch()
    patch.setattr(wan, "dispatch_attention_fn", capture)
    try:
        with torch.no_grad():
            attn(x, rotary_emb=rotary)
            q = attn.norm_q(attn.to_q(x)).unflatten(2, (heads, -1))
    finally:
        patch.undo()
    return q, seen["q"]


def _complex128_oracle(x, grid, head_dim, seq_dim):
    """The original Wan rotation: float64 angles, x's pairs as complex128 numbers."""
    angles = rope3d._angles(grid, head_dim, 10000.0)
    shape = [1] * (x.dim() - 1)
    shape[seq_dim] = angles.shape[0]
    turn = torch.polar(torch.ones_like(angles), angles).reshape(*shape, head_dim // 2)
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2)


@pytest.mark.parametrize(("grid", "head_dim"), GRIDS)
def test_tables_equal_diffusers_tables(grid, head_dim):
    f, h, w = grid
    want_cos, want_sin = wan.WanRotaryPosEmbed(head_dim, (1, 1, 1), 32)(torch.zeros(1, 1, f, h, w))
    cos, sin = rope3d.rope_tables(grid, head_dim)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == (f * h * w, head_dim // 2)
    # diffusers repeats each pair's value twice: (1, S, 1, head_dim)
    torch.testing.assert_close(cos, want_cos[0, :, 0, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(sin, want_sin[0, :, 0, 1::2], rtol=0, atol=0)


@pytest.mark.parametrize(("grid", "head_dim"), GRIDS)
def test_apply_equals_diffusers_wan_processor(grid, head_dim):
    q, want = _diffusers_rope_and_query(grid, head_dim)
    cos, sin = rope3d.rope_tables(grid, head_dim)
    got = rope3d.apply_rope(q, cos, sin, seq_dim=1)  # (batch, seq, heads, head_dim)
    # both float32 from identical tables; only the rounding of x*cos -/+ y*sin may differ
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, q)  # the rotation did something


@pytest.mark.parametrize(("grid", "head_dim"), GRIDS)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_apply_equals_float64_complex_rotation(grid, head_dim, layout):
    seq = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, seq, head_dim) if layout == "bhsd" else (2, seq, 3, head_dim)
    seq_dim = 2 if layout == "bhsd" else 1
    x = torch.randn(shape, generator=g)
    got = rope3d.apply_rope(x, *rope3d.rope_tables(grid, head_dim), seq_dim=seq_dim)
    want = _complex128_oracle(x, grid, head_dim, seq_dim)
    assert got.dtype == torch.float32
    # fp32 tolerance: tables and products each rounded once to float32 (|x| < ~5)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=2e-6)


def test_apply_low_precision_rounds_once():
    grid, head_dim = (2, 4, 4), 24
    x = torch.randn(1, 2, 32, head_dim, generator=torch.Generator().manual_seed(2))
    got = rope3d.apply_rope(x.bfloat16(), *rope3d.rope_tables(grid, head_dim))
    want = _complex128_oracle(x.bfloat16().float(), grid, head_dim, 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want.bfloat16().double(), rtol=8e-3, atol=8e-3)


def test_cache_hits_misses_and_lru_eviction():
    first = rope3d.rope_tables((2, 2, 2), 12)
    assert rope3d.cache_info() == rope3d.CacheInfo(0, 1, 1, rope3d.CACHE_SIZE)
    again = rope3d.rope_tables((2, 2, 2), 12, device="cpu", dtype=torch.float32, theta=1e4)
    assert again[0] is first[0]
    assert again[1] is first[1]
    assert rope3d.cache_info().hits == 1
    # every part of the key makes a new entry
    rope3d.rope_tables((2, 2, 3), 12)
    rope3d.rope_tables((2, 2, 2), 18)
    rope3d.rope_tables((2, 2, 2), 12, dtype=torch.bfloat16)
    rope3d.rope_tables((2, 2, 2), 12, theta=500.0)
    assert rope3d.cache_info() == rope3d.CacheInfo(1, 5, 5, rope3d.CACHE_SIZE)
    # fill the cache; (2, 2, 2) was used most recently of the first entries when touched
    rope3d.rope_tables((2, 2, 2), 12)
    for n in range(rope3d.CACHE_SIZE - 4):
        rope3d.rope_tables((1, 1, n + 10), 12)
    info = rope3d.cache_info()
    assert info.size == rope3d.CACHE_SIZE
    assert info.misses == 5 + rope3d.CACHE_SIZE - 4
    assert rope3d.rope_tables((2, 2, 2), 12)[0] is first[0]  # kept: recently used
    misses = rope3d.cache_info().misses
    rope3d.rope_tables((2, 2, 3), 12)  # the least recently used one was evicted
    assert rope3d.cache_info().misses == misses + 1
    assert rope3d.cache_info().size == rope3d.CACHE_SIZE


def test_numpy_and_tensor_integers_are_taken_as_sparse_attention_takes_them():
    """``rope_tables`` refused an ``np.int64`` size (one from ``np.array(shape) // patch``) that
    ``sparse_attention``'s ``latent_shape`` takes; they name the same cached tables now."""
    first = rope3d.rope_tables((2, 3, 4), 12)
    for grid, head_dim in [
        ((np.int64(2), np.int32(3), torch.tensor(4)), np.int64(12)),
        (np.array([2, 3, 4]), torch.tensor(12)),
    ]:
        assert rope3d.rope_tables(grid, head_dim)[0] is first[0]
    assert rope3d.cache_info().hits == 2
    assert rope3d.split(np.int64(12)) == (4, 4, 4)
    with pytest.raises(ValueError, match="three positive ints"):
        rope3d.rope_tables((True, 2, 2), 12)
    for unordered in ({4, 3, 2}, {4: 0, 3: 0, 2: 0}, iter((2, 3, 4))):  # sizes reordered
        with pytest.raises(ValueError, match="three positive ints"):
            rope3d.rope_tables(unordered, 12)
    with pytest.raises(TypeError, match="head_dim must be an int, got bool"):
        rope3d.rope_tables((2, 2, 2), True)
    with pytest.raises(ValueError, match="must be even and at least 6, got 13"):
        rope3d.rope_tables((2, 2, 2), np.int64(13))


def test_numpy_and_tensor_real_thetas_are_taken_as_the_same_float():
    """``theta=np.float32(10000)`` or ``np.int64(10000)`` was refused ("theta must be a positive
    finite number") though lite-boost's other numbers take numpy's; they, and 0-d tensors, name
    the same cached tables as the float now. Bools, NaN, inf and <= 0 stay refused."""
    first = rope3d.rope_tables((2, 2, 2), 12, theta=10000.0)
    for theta in (10000, np.float32(10000), np.int64(10000), np.float16(10000), torch.tensor(1e4)):
        assert rope3d.rope_tables((2, 2, 2), 12, theta=theta)[0] is first[0]
    assert rope3d.rope_tables((2, 2, 2), 12, theta=torch.tensor(10000))[0] is first[0]
    bad = [
        True,
        np.bool_(True),
        torch.tensor(True),
        np.float32("nan"),
        np.float64("inf"),
        torch.tensor(float("nan")),
        np.int64(0),
        -1.0,
        torch.tensor(-2.0),
        10**400,
        torch.tensor([1e4]),
        1e4 + 0j,
        "10000",
        None,
    ]
    for theta in bad:
        with pytest.raises(ValueError, match="theta must be a positive finite number"):
            rope3d.rope_tables((2, 2, 2), 12, theta=theta)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"grid": (2, 2, 2), "head_dim": 13}, ValueError, "head_dim must be even and at least 6"),
        ({"grid": (2, 2, 2), "head_dim": 4}, ValueError, "head_dim must be even and at least 6"),
        ({"grid": (2, 2, 2), "head_dim": 12.0}, TypeError, "head_dim must be an int"),
        ({"grid": (2, 2), "head_dim": 12}, ValueError, "three positive ints"),
        ({"grid": (2, 0, 2), "head_dim": 12}, ValueError, "three positive ints"),
        ({"grid": (2, 2, 2), "head_dim": 12, "dtype": torch.int32}, TypeError, "floating"),
        ({"grid": (2, 2, 2), "head_dim": 12, "theta": 0.0}, ValueError, "theta"),
        ({"grid": (2, 2, 2), "head_dim": 12, "theta": float("inf")}, ValueError, "finite"),
    ],
)
def test_bad_table_requests(kwargs, error, match):
    with pytest.raises(error, match=match):
        rope3d.rope_tables(**kwargs)


def test_bad_apply_inputs():
    cos, sin = rope3d.rope_tables((2, 2, 2), 12)
    with pytest.raises(ValueError, match=r"x.shape\[2\] must be 8"):
        rope3d.apply_rope(torch.zeros(1, 2, 9, 12), cos, sin)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] 12"):
        rope3d.apply_rope(torch.zeros(1, 2, 8, 14), cos, sin)
    with pytest.raises(ValueError, match="before its last"):
        rope3d.apply_rope(torch.zeros(1, 2, 8, 12), cos, sin, seq_dim=3)
    with pytest.raises(ValueError, match=r"\(seq, head_dim // 2\) tables"):
        rope3d.apply_rope(torch.zeros(1, 2, 8, 12), cos[None], sin[None])
