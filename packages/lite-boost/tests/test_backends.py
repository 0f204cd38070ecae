"""Attention backend selection: the op against SDPA, the choice, the override, bad input."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import logging
import types

import pytest
import torch
import torch.nn.functional as F

from lite_boost import backends as A
from lite_boost import sparse_attention
from spore import dispatch


def _qkv(heads=4, kv_heads=4, seq=24, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, dim, generator=g, dtype=dtype)
    k = torch.randn(2, kv_heads, seq + 5, dim, generator=g, dtype=dtype)
    v = torch.randn(2, kv_heads, seq + 5, dim, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_sdpa_with_grouped_heads(dtype):
    q, k, v = _qkv(heads=4, kv_heads=2, dtype=dtype)
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.3
    )
    torch.testing.assert_close(A.attention(q, k, v, scale=0.3), want)


def test_cpu_runs_sdpa_and_explain_says_so():
    q, k, v = _qkv()
    e = dispatch.explain(A.OP, q, k, v)
    assert e.chosen == "lite-boost:sdpa"
    assert [c.provider for c in e.candidates] == ["lite-boost:sdpa"]


def test_forcing_a_backend_that_cannot_run_falls_back_to_the_reference(monkeypatch):
    q, k, v = _qkv()
    with A.use_backend("flash_attn_2"):
        assert dispatch.explain(A.OP, q, k, v).chosen == "reference"
        torch.testing.assert_close(A.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert dispatch.explain(A.OP, q, k, v).chosen == "lite-boost:sdpa"
    monkeypatch.setenv(A.ENV, "torch_npu")
    assert dispatch.explain(A.OP, q, k, v).chosen == "reference"
    monkeypatch.setenv(A.ENV, "sdpa")
    assert dispatch.explain(A.OP, q, k, v).chosen == "lite-boost:sdpa"


def test_a_forced_backend_still_takes_only_calls_it_can_run(monkeypatch):
    # were flash_attn installed on a CUDA machine, forcing it must not hand it fp32 or
    # head_dim 300 (flash_attn_func raises): the call goes to SDPA instead
    by_name = {(b.name, b.device): b for b in A.BACKENDS}
    q, k, v = _qkv()
    wide = torch.randn(1, 2, 4, 300)
    flash, npu = (
        A._supports(by_name["flash_attn_2", "cuda"]),
        A._supports(by_name["torch_npu", "npu"]),
    )
    cpu_sdpa = A._supports(by_name["sdpa", "cpu"])
    monkeypatch.setenv(A.ENV, "flash_attn_2")
    assert not flash(wide, wide, wide)
    assert not cpu_sdpa(q, k, v)
    monkeypatch.setenv(A.ENV, "torch_npu")
    assert not npu(wide, wide, wide)
    monkeypatch.setenv(A.ENV, "sdpa")
    assert cpu_sdpa(q, k, v)


def test_use_backend_none_is_automatic_whatever_the_environment_says(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setenv(A.ENV, "torch_npu")
    assert dispatch.explain(A.OP, q, k, v).chosen == "reference"
    with A.use_backend(None):
        assert A.forced() is None
        assert dispatch.explain(A.OP, q, k, v).chosen == "lite-boost:sdpa"
        with A.use_backend("torch_npu"):
            assert A.forced() == "torch_npu"
        assert A.forced() is None
    assert A.forced() == "torch_npu"


def test_unknown_backends_are_refused(monkeypatch):
    with (
        pytest.raises(ValueError, match="unknown attention backend 'flash'"),
        A.use_backend("flash"),
    ):
        pass
    monkeypatch.setenv(A.ENV, "flash")
    q, k, v = _qkv()
    for call in (A.attention, torch.ops.spore.lite_boost_attention):  # the op ran SDPA
        with pytest.raises(
            ValueError, match="LITE_BOOST_ATTENTION='flash' is not an attention backend"
        ):
            call(q, k, v)


@pytest.mark.parametrize(
    ("shapes", "match"),
    [
        (((2, 4, 8), (2, 4, 8), (2, 4, 8)), "takes \\(batch, heads, seq, head_dim\\)"),
        (((2, 4, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16)), "multiple of k/v's 3"),
        (((2, 4, 8, 16), (2, 4, 8, 8), (2, 4, 8, 8)), "in batch and head_dim"),
        (((2, 0, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), "need at least one head each"),
    ],
)
def test_bad_shapes_raise(shapes, match):
    with pytest.raises(ValueError, match=match):
        A.attention(*(torch.randn(s) for s in shapes))


def test_v_may_have_its_own_head_dim_as_sdpa_takes_it():
    """SDPA takes v of another head_dim than q and k (e.g. latent attention's 192 and 128);
    lite-boost's checks refused it. Sparse attention (one head_dim) still refuses it, naming
    why."""
    q, k, v = _qkv(heads=4, kv_heads=2, dim=16)
    v = torch.randn(*v.shape[:3], 8)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(A.attention(q, k, v), expected)
    assert A.attention(q, k, v).shape == (*q.shape[:3], 8)
    with pytest.raises(ValueError, match="sparse attention takes v of q's head_dim 16"):
        sparse_attention(q, k, v, latent_shape=(1, 4, 6), text_len=0, sparsity=0.5)


@pytest.mark.parametrize(
    "dtypes",
    [(torch.int64,) * 3, (torch.float32, torch.bfloat16, torch.float32), (torch.bool,) * 3],
)
def test_integer_or_mixed_dtypes_raise_a_type_error_naming_them(dtypes):
    """SDPA's own error for these ("expected scalar type Float but found Long") named neither
    the argument nor the fix; the sparse path's kernel already named them."""
    q, k, v = (torch.ones(1, 2, 4, 8).to(d) for d in dtypes)
    with pytest.raises(TypeError, match="floating-point q, k and v of one dtype, got "):
        A.attention(q, k, v)
    with pytest.raises(TypeError, match="floating-point q, k and v of one dtype"):
        sparse_attention(q, k, v, latent_shape=(1, 1, 4), text_len=0, sparsity=0.0)


def test_mixed_dtypes_under_autocast_are_cast_as_sdpa_casts_them():
    """Autocast casts SDPA's inputs to one dtype: the dtype check must not refuse them first;
    float64, which autocast leaves, and tensors of a device without autocast still are."""
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).bfloat16(), torch.randn(1, 2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = A.attention(q, k, v), F.scaled_dot_product_attention(q, k, v)
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        with pytest.raises(TypeError, match=r"torch\.float64, torch\.float32, torch\.float32"):
            A.attention(q.double(), v, v)
        with pytest.raises(TypeError, match="of one dtype"):
            A.check_qkv(q.to("meta"), k.to("meta"), v.to("meta"))


@pytest.mark.parametrize("path", ["dense", "sparse"])
def test_mixed_dtypes_under_autocast_compile_and_go_sparse_as_in_eager(path):
    """The mixes eager autocast takes were refused by ``torch.compile`` (the op's fake saw them
    uncast) and by the sparse kernel: the op casts them in its autocast kernel now, and
    ``sparse_attention`` as the op does, so eager, compiled and sparse agree."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    k = k.bfloat16()
    if path == "dense":
        fn = A.attention
    else:
        fn = functools.partial(sparse_attention, latent_shape=(1, 4, 4), sparsity=0.5, block_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = fn(q.bfloat16(), k, v.bfloat16())
        got = fn(q, k, v)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert got.dtype == compiled.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(compiled, want, atol=0, rtol=0)


def test_explain_under_autocast_names_the_kernel_that_runs():
    """Under autocast the op's kernels get q, k and v cast to autocast's dtype: explain judged
    them uncast, so it named a kernel other than the one that ran."""
    ran = []

    def bf16_only(q, k, v, scale=None):
        ran.append(q.dtype)
        return A.reference(q, k, v, scale)

    dispatch.register_kernel(
        A.OP,
        "cpu",
        bf16_only,
        provider="test-bf16-only",
        priority=100,
        supports=lambda q, k, v, scale=None: q.dtype == k.dtype == v.dtype == torch.bfloat16,
    )
    try:
        q, k, v = _qkv()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert dispatch.explain(A.OP, q, k, v).chosen == "test-bf16-only"
            A.attention(q, k, v)
            assert ran == [torch.bfloat16]
            # a mix autocast casts to one dtype: SDPA's kernel takes it, not the reference
            dispatch.unregister_provider("test-bf16-only")
            assert dispatch.explain(A.OP, q, k.bfloat16(), v).chosen == "lite-boost:sdpa"
        assert dispatch.explain(A.OP, q, k, v).chosen == "lite-boost:sdpa"
        assert dispatch.explain(A.OP, q, k.bfloat16(), v).chosen == "reference"
    finally:
        dispatch.unregister_provider("test-bf16-only")


@pytest.mark.parametrize("name", ["flash_attn_2", "torch_npu"])
def test_device_kernels_get_the_checks_the_sdpa_path_runs(name):
    """FlashAttention's and torch_npu's kernels were handed q, k and v that SDPA's path
    refuses with lite-boost's error (they failed inside the kernel instead), and a head_dim
    without unit stride: the same backends on CPU, around a stand-in for the package, take
    only well-formed calls; the rest get SDPA's error, or SDPA itself."""
    calls = []

    def sdpa(q, k, v, scale):  # a device kernel's own checks, not lite-boost's
        calls.append(q.shape)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    def flash_attn_func(q, k, v, softmax_scale=None):  # flash-attn's (batch, seq, heads, dim)
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale)
        return out.transpose(1, 2)

    def npu_fused_infer_attention_score(q, k, v, *, scale, **layout):
        return sdpa(q, k, v, scale), None

    module = types.SimpleNamespace(
        flash_attn_func=flash_attn_func,
        npu_fused_infer_attention_score=npu_fused_infer_attention_score,
    )
    backend = next(b for b in A.BACKENDS if b.name == name)
    backend = dataclasses.replace(backend, device="cpu", dtypes=(torch.float32,))
    kernel = A._npu(module) if name == "torch_npu" else A._flash(module, 2)
    provider = f"test-{name}-on-cpu"
    dispatch.register_kernel(
        A.OP, "cpu", kernel, provider=provider, priority=100, supports=A._supports(backend)
    )
    try:
        q, k, v = _qkv()
        torch.testing.assert_close(A.attention(q, k, v), A.reference(q, k, v))
        assert len(calls) == 1  # the stand-in takes well-formed calls
        bad = torch.randn(2, 3, 29, 16)  # heads that q's 4 are no multiple of
        with pytest.raises(ValueError, match="multiple of k/v's 3"):
            A.attention(q, bad, bad)
        reason = next(c.reason for c in dispatch.explain(A.OP, q, bad, bad).candidates)
        assert "supports() raised ValueError: q's 4 heads must be a multiple" in reason
        with pytest.raises(ValueError, match=r"takes \(batch, heads, seq, head_dim\)"):
            A.attention(q[0], k[0], v[0])
        strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride 24
        assert dispatch.explain(A.OP, strided, k, v).chosen == "lite-boost:sdpa"
        torch.testing.assert_close(A.attention(strided, k, v), A.reference(q, k, v))
        narrow = v[..., :8]  # another head_dim for v: SDPA's, not the device kernel's
        assert dispatch.explain(A.OP, q, k, narrow).chosen == "lite-boost:sdpa"
        assert len(calls) == 1
    finally:
        dispatch.unregister_provider(provider)


def test_the_op_is_named_in_one_place():
    """``backends`` calls the op through its definition, never by a name written out again."""
    tree = ast.parse(inspect.getsource(A))
    names = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    assert A.OP not in names
    assert strings.count(A.OP) == 1  # OP = "lite_boost_attention"
    q, k, v = _qkv()
    torch.testing.assert_close(A.attention(q, k, v), A.reference(q, k, v))


@pytest.mark.parametrize(
    ("error", "logged"),
    [
        (OSError("libcudart.so.12: cannot open shared object file"), "raised OSError: libcudart"),
        # flash-attn installed without its compiled extension: it was taken for flash-attn not
        # being installed, and skipped unlogged
        (ModuleNotFoundError("No module named 'x_cuda'", name="x_cuda"), "No module named 'x_"),
        (ModuleNotFoundError("No module named 'flash_attn'", name="flash_attn"), None),  # absent
    ],
)
def test_a_broken_backend_is_skipped_with_a_reason(monkeypatch, caplog, error, logged):
    import importlib

    real = importlib.import_module

    def fake(name, *args):
        if name == "flash_attn":
            raise error
        return real(name, *args)

    backend = next(b for b in A.BACKENDS if b.name == "flash_attn_2")
    monkeypatch.setattr(A.importlib, "import_module", fake)
    A._implementation.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="lite_boost"):
            assert A._implementation(backend) is None
    finally:
        A._implementation.cache_clear()
    if logged is None:
        assert "skipped" not in caplog.text
    else:
        assert "flash_attn_2 skipped: importing flash_attn raised" in caplog.text
        assert logged in caplog.text
