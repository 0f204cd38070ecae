"""The checks every layer shares: the readiness check kernels start from, and the clear error
for tensors on two devices."""

from __future__ import annotations

import pytest
import torch

import spore_kernels  # noqa: F401  (defines torch.ops.spore.*)
from spore_kernels import _checks


def test_ready_takes_contiguous_tensors_of_one_kernel_dtype_on_one_device() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    assert _checks.ready(x, w)
    assert _checks.ready(x, w, device_type="cpu")
    assert _checks.ready(x.bfloat16(), w.bfloat16())
    assert _checks.ready(x.half())
    assert not _checks.ready(x, w, device_type="cuda")
    assert not _checks.ready(x.double())  # float64 runs the reference
    assert not _checks.ready(x, w.bfloat16())  # mixed dtypes
    assert not _checks.ready(x.t())  # not contiguous
    assert not _checks.ready(x, w.to("meta"))  # two devices
    assert not _checks.ready(x.to(torch.int32))
    assert not _checks.ready(x.to_sparse())  # not strided
    if torch.backends.mkldnn.is_available():
        assert not _checks.ready(x.to_mkldnn())  # says it is contiguous


class _ClaimsContiguous(torch.Tensor):
    """A tensor subclass whose own is_contiguous() says True of any layout: were it believed, a
    kernel would read a dense buffer past the tensor's memory."""

    def is_contiguous(self, *args, **kwargs):
        return True


def test_ready_refuses_tensor_subclasses_but_parameters() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    assert _checks.ready(x, torch.nn.Parameter(w))
    assert not _checks.ready(x.as_subclass(_ClaimsContiguous), w)
    assert not _checks.ready(x, w.as_subclass(_ClaimsContiguous))


def test_a_subclass_claiming_contiguity_runs_the_reference() -> None:
    """32 logical elements over 16 stored, said to be contiguous: the ops compute the right
    values (the reference's) instead of the kernels reading past the storage."""
    from spore_kernels.ops import gelu, rms_norm

    base = torch.randn(16)
    plain = base.as_strided((4, 8), (1, 0))
    lying = plain.as_subclass(_ClaimsContiguous)
    w = torch.randn(8)
    got = torch.ops.spore.rms_norm(lying, w, 1e-6).as_subclass(torch.Tensor)
    torch.testing.assert_close(got, rms_norm.reference(plain, w, 1e-6))
    wide = torch.randn(64).as_strided((1000,), (0,))
    got = torch.ops.spore.gelu(wide.as_subclass(_ClaimsContiguous)).as_subclass(torch.Tensor)
    torch.testing.assert_close(got, gelu.reference(wide))


def test_tensors_on_different_devices_are_a_clear_error() -> None:
    x, cs = torch.randn(4, 8), torch.randn(4, 8)
    meta_row, meta_x = torch.randn(8, device="meta"), torch.randn(4, 8, device="meta")
    calls = {
        "rms_norm": lambda: torch.ops.spore.rms_norm(x, meta_row, 1e-6),
        "add_rms_norm": lambda: torch.ops.spore.add_rms_norm(x, meta_x, torch.ones(8), 1e-6),
        "layer_norm": lambda: torch.ops.spore.layer_norm(x, meta_row, None, 1e-6),
        "rope": lambda: torch.ops.spore.rope(x, cs.to("meta"), cs, "half"),
        "silu_mul": lambda: torch.ops.spore.silu_mul(x, meta_x),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"{name}: .* is on cpu but .* is on meta"):
            call()


def _backward_calls(grad: torch.Tensor, grad_rows: torch.Tensor) -> dict:
    """Each public backward op called with ``grad`` where its forward's output is [4, 8], and
    mean_var's with ``grad_rows`` where its output is [4]."""
    x, w = torch.randn(4, 8), torch.ones(8)
    return {
        "gelu_backward": lambda: torch.ops.spore.gelu_backward(grad, x, "tanh"),
        "silu_mul_backward": lambda: torch.ops.spore.silu_mul_backward(grad, x, x),
        "swiglu_backward": lambda: torch.ops.spore.swiglu_backward(grad, torch.randn(4, 16)),
        "rms_norm_backward": lambda: torch.ops.spore.rms_norm_backward(grad, x, w, 1e-6),
        "add_rms_norm_backward": lambda: torch.ops.spore.add_rms_norm_backward(
            torch.ones(4, 8), grad, x, w, 1e-6
        ),
        "layer_norm_backward": lambda: torch.ops.spore.layer_norm_backward(grad, x, w, w, 1e-6),
        "mean_var_backward": lambda: torch.ops.spore.mean_var_backward(grad_rows, None, x, 1, 1),
    }


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("grad_shape", [(2, 4, 8), (1, 8), (4, 1)])
def test_a_gradient_not_shaped_like_the_output_is_a_clear_error(grad_shape, fake) -> None:
    """Each shape broadcasts against [4, 8]: without the check the first gave a silently
    wrong (broadcast) gradient from gelu_backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = _backward_calls(torch.ones(grad_shape), torch.ones(grad_shape))
    for name, call in calls.items():
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
        with mode, pytest.raises(ValueError, match=rf"{name}: .* forward output's shape"):
            call()
    good = _backward_calls(torch.ones(4, 8), torch.ones(4))
    for call in good.values():
        assert call() is not None


@pytest.mark.parametrize("fake", [False, True])
def test_an_integer_gradient_is_a_clear_error(fake) -> None:
    """gelu_backward and silu_mul_backward took it and the norms returned an int64 dx;
    rope_backward named its x."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = _backward_calls(torch.ones(4, 8, dtype=torch.int64), torch.ones(4, dtype=torch.int64))
    cs = torch.randn(4, 8)
    calls["rope_backward"] = lambda: torch.ops.spore.rope_backward(
        torch.ones(4, 8, dtype=torch.int64), cs, cs, "half"
    )
    for name, call in calls.items():
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
        with mode, pytest.raises(TypeError, match=rf"{name}: grad\w* must be a floating-point"):
            call()


@pytest.mark.parametrize("fake", [False, True])
def test_the_norms_backward_check_the_weight_as_their_forward_does(fake) -> None:
    """A weight not of x's last dimension failed inside torch's broadcasting."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, g, w = torch.randn(3, 4), torch.randn(3, 4), torch.randn(5)
    calls = [
        lambda: torch.ops.spore.rms_norm_backward(g, x, w, 1e-6),
        lambda: torch.ops.spore.add_rms_norm_backward(g, None, x, w, 1e-6),
        lambda: torch.ops.spore.layer_norm_backward(g, x, w, None, 1e-6),
    ]
    for call in calls:
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
        with mode, pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
            call()


def _norm_calls(eps: float, dtype: torch.dtype) -> dict:
    """Each norm op, forward and backward, on [4, 8] inputs of ``dtype`` with ``eps``."""
    x, w = torch.randn(4, 8, dtype=dtype), torch.randn(8, dtype=dtype)
    spore = torch.ops.spore
    return {
        "rms_norm": lambda: spore.rms_norm(x, w, eps),
        "rms_norm_backward": lambda: spore.rms_norm_backward(x, x, w, eps),
        "add_rms_norm": lambda: spore.add_rms_norm(x, x, w, eps),
        "add_rms_norm_backward": lambda: spore.add_rms_norm_backward(x, None, x, w, eps),
        "layer_norm": lambda: spore.layer_norm(x, w, w, eps),
        "layer_norm_backward": lambda: spore.layer_norm_backward(x, x, w, w, eps),
    }


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("eps", [-1.0, -1e-6, float("nan"), float("inf"), float("-inf"), 1e39])
def test_a_negative_or_non_finite_eps_is_a_clear_error(eps, dtype, fake) -> None:
    """The C++ kernels took it and returned NaN rows (eps -1.0, NaN) or zeros (inf, and 1e39:
    finite in Python, inf in float32) silently."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, call in _norm_calls(eps, dtype).items():
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
        with mode, pytest.raises(ValueError, match=rf"{name}: eps must be a number >= 0 finite"):
            call()


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_eps_zero_and_positive_still_run_the_kernels(eps) -> None:
    from spore import dispatch

    x, w = torch.randn(4, 8), torch.randn(8)
    assert dispatch.explain("rms_norm", x, w, eps).chosen == "kernels"
    assert dispatch.explain("layer_norm", x, w, None, eps).chosen == "kernels"
    assert dispatch.explain("add_rms_norm", x, x, w, eps).chosen == "kernels"
    for call in _norm_calls(eps, torch.float32).values():
        out = call()
        assert all(t is None or bool(t.isfinite().all()) for t in out if not isinstance(t, float))


def _attention_calls(scale: float) -> dict:
    """Each attention op, forward and backward, on small float32 inputs with ``scale``."""
    x = torch.randn(1, 2, 3, 2, 4)  # triangle attention: [*, I, J, H, D]
    q = torch.randn(1, 1, 8, 4)  # block-sparse: (B, H, S, D), two blocks of 4
    index, count = torch.tensor([[[[0], [1]]]]), torch.ones(1, 1, 2, dtype=torch.int64)
    spore = torch.ops.spore
    return {
        "triangle_attention": lambda: spore.triangle_attention(x, x, x, scale=scale),
        "triangle_attention_backward": lambda: spore.triangle_attention_backward(
            x, x, x, x, None, None, x, scale
        ),
        "block_sparse_attention": lambda: spore.block_sparse_attention(
            q, q, q, index, count, 4, scale
        ),
    }


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("scale", [1e39, -1e39, 3.5e38, float("nan"), float("inf")])
def test_a_scale_not_finite_in_float32_is_a_clear_error(scale, fake) -> None:
    """1e39 is finite as a Python float but inf in float32: the kernels and the references
    alike returned NaN outputs without a word."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for name, call in _attention_calls(scale).items():
        op = name.removesuffix("_backward")  # the backward's errors name its forward
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.no_grad()
        with mode, pytest.raises(ValueError, match=rf"{op}: scale must be finite in float32"):
            call()


_KERNEL_SCALE_MAX = 2.3586574359122396e38
"""The largest float32 whose float32 product with log2 e is finite (FLT_MAX / log2 e)."""


def _tiny_scores() -> dict:
    """Each attention op's inputs (forward, then its backward's) whose scores stay small under
    a scale near float32's largest: q and k of 1e-19 and 2e-19."""
    qt = torch.full((1, 1, 2, 1, 4), 1e-19)  # triangle attention: [*, I, J, H, D]
    kt = qt.clone()
    kt[0, 0, 1] = 2e-19
    vt = torch.randn(1, 1, 2, 1, 4)
    qb = torch.full((1, 1, 4, 4), 1e-19)  # block-sparse: one block of 4
    kb = qb.clone()
    kb[..., 1, :] = 2e-19
    index, count = (
        torch.zeros(1, 1, 1, 1, dtype=torch.int64),
        torch.ones(1, 1, 1, dtype=torch.int64),
    )
    return {
        "triangle_attention": (qt, kt, vt, None, None),
        "triangle_attention_backward": (torch.ones_like(vt), qt, kt, vt, None, None, vt),
        "block_sparse_attention": (qb, kb, torch.randn(1, 1, 4, 4), index, count, 4),
    }


@pytest.mark.parametrize("scale", [_KERNEL_SCALE_MAX, -_KERNEL_SCALE_MAX, 0.0, None])
def test_a_scale_the_kernels_take_runs_them(scale) -> None:
    from spore import dispatch

    for name, args in _tiny_scores().items():
        assert dispatch.explain(name, *args, scale).chosen == "kernels", name
        out = getattr(torch.ops.spore, name)(*args, scale)
        assert all(bool(t.isfinite().all()) for t in (out if isinstance(out, tuple) else [out]))


@pytest.mark.parametrize("scale", [2.4e38, -3e38, _checks.FLOAT32_MAX])
def test_a_scale_past_the_kernels_base_2_range_runs_the_reference(scale) -> None:
    """The kernels compute scale * log2 e in float32, inf past about 2.36e38: every output was
    NaN (gradients too) where the reference's are finite. Dispatch now runs the reference; the
    kernels called directly refuse the scale."""
    from spore import dispatch
    from spore_kernels.ops import block_sparse_attention, triangle_attention

    direct = {
        "triangle_attention": triangle_attention.cpu,
        "triangle_attention_backward": triangle_attention.cpu_backward,
        "block_sparse_attention": block_sparse_attention.cpu,
    }
    for name, args in _tiny_scores().items():
        assert dispatch.explain(name, *args, scale).chosen == "reference", name
        out = getattr(torch.ops.spore, name)(*args, scale)
        assert all(bool(t.isfinite().all()) for t in (out if isinstance(out, tuple) else [out]))
        with pytest.raises(ValueError, match=rf"{name}: the kernel takes \|scale\| <= 2.359e\+38"):
            direct[name](*args, scale)


_NONE_CALLS = {
    "rms_norm: weight": lambda x: torch.ops.spore.rms_norm(x, None, 1e-6),
    "rms_norm: x": lambda x: torch.ops.spore.rms_norm(None, x[0], 1e-6),
    "add_rms_norm: residual": lambda x: torch.ops.spore.add_rms_norm(x, None, x[0], 1e-6),
    "layer_norm: x": lambda x: torch.ops.spore.layer_norm(None, None, None, 1e-6),
    "mean_var: x": lambda x: torch.ops.spore.mean_var(None, 0, 1),
    "gelu: x": lambda x: torch.ops.spore.gelu(None, "none"),
    "silu_mul: b": lambda x: torch.ops.spore.silu_mul(x, None),
    "swiglu: x": lambda x: torch.ops.spore.swiglu(None),
    "rope: cos": lambda x: torch.ops.spore.rope(x, None, x, "half"),
    "triangle_attention: k": lambda x: torch.ops.spore.triangle_attention(x, None, x),
    "block_sparse_attention: v": lambda x: torch.ops.spore.block_sparse_attention(
        x, x, None, x.int(), x.int(), 4
    ),
}


@pytest.mark.parametrize("where", list(_NONE_CALLS))
def test_none_for_a_tensor_argument_is_a_clear_error(where) -> None:
    """torch.ops passes None for a Tensor argument through; it failed with AttributeError
    ('NoneType' object has no attribute 'dtype'). The core's dispatch refuses it, as
    ``spore.dispatch.explain`` does."""
    op, arg = where.split(": ")
    x = torch.randn(4, 8)
    with pytest.raises(
        TypeError, match=rf"^{op}\(\): argument '{arg}' must be a Tensor, got NoneType"
    ):
        _NONE_CALLS[where](x)


_LAYOUTS = {
    "sparse_coo": lambda t: t.to_sparse(),
    "sparse_csr": lambda t: t.to_sparse_csr(),
    "mkldnn": lambda t: t.to_mkldnn(),
}
_NO_MKLDNN = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch is built without oneDNN"
)

_DENSE_CALLS = {  # each op given x (4 x 8) as its first tensor
    "rms_norm": lambda x, d: torch.ops.spore.rms_norm(x, d[0], 1e-6),
    "add_rms_norm": lambda x, d: torch.ops.spore.add_rms_norm(x, d, d[0], 1e-6),
    "layer_norm": lambda x, d: torch.ops.spore.layer_norm(x, None, None, 1e-6),
    "mean_var": lambda x, d: torch.ops.spore.mean_var(x, 0, 1),
    "gelu": lambda x, d: torch.ops.spore.gelu(x, "none"),
    "silu_mul": lambda x, d: torch.ops.spore.silu_mul(x, d),
    "swiglu": lambda x, d: torch.ops.spore.swiglu(x),
    "rope": lambda x, d: torch.ops.spore.rope(x, d, d, "half"),
    "rms_norm_backward": lambda x, d: torch.ops.spore.rms_norm_backward(x, d, d[0], 1e-6),
}


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=_NO_MKLDNN) if k == "mkldnn" else k for k in _LAYOUTS]
)
@pytest.mark.parametrize("op", list(_DENSE_CALLS))
def test_a_tensor_not_dense_is_a_clear_error(op, layout) -> None:
    """A sparse x reached the reference's arithmetic, which failed with torch's internal assert
    ('new_nnz <= nnz()', 'please report a bug to PyTorch'); an MKL-DNN one found no kernel."""
    dense = torch.randn(4, 8)
    with pytest.raises(TypeError, match=rf"^{op}: \w+ must be a dense \(strided\) tensor"):
        _DENSE_CALLS[op](_LAYOUTS[layout](dense), dense)


def test_attention_refuses_sparse_inputs_lists_and_masks() -> None:
    q = torch.randn(1, 2, 3, 2, 4)
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"^triangle_attention: k must be a dense"):
        torch.ops.spore.triangle_attention(q, q.to_sparse(), q)
    with pytest.raises(TypeError, match=r"^triangle_attention: mask must be a dense"):
        torch.ops.spore.triangle_attention(q, q, q, None, mask.to_sparse())
    q = torch.randn(1, 2, 8, 4)
    index = torch.zeros(1, 2, 1, 1, dtype=torch.int32)
    count = torch.ones(1, 2, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^block_sparse_attention: v must be a dense"):
        torch.ops.spore.block_sparse_attention(q, q, q.to_sparse(), index, count, 8)
    for lists, name in (
        ((index.to_sparse(), count), "kv_block_index"),
        ((index, count.to_sparse()), "kv_block_count"),
    ):
        with pytest.raises(TypeError, match=rf"^block_sparse_attention: {name} must be a dense"):
            torch.ops.spore.block_sparse_attention(q, q, q, *lists, 8)


def _direct_calls() -> dict:
    """Each op's C++ kernel called directly (``ops.<op>.cpu*``) with a weight or second operand
    of one element, or of another dtype: read past its end or as the wrong type, it crashed."""
    from spore_kernels.ops import add_rms_norm, gelu, glu, layer_norm, mean_var, rms_norm, rope

    x, one, wide = torch.randn(64, 256), torch.randn(1), torch.randn(256, dtype=torch.float64)
    cos = torch.randn(64, 256)
    return {
        "rms_norm": lambda: rms_norm.cpu(x, one, 1e-6),
        "rms_norm_backward": lambda: rms_norm.cpu_backward(x, x, wide, 1e-6),
        "add_rms_norm": lambda: add_rms_norm.cpu(x, one, one, 1e-6),
        "add_rms_norm_backward": lambda: add_rms_norm.cpu_backward(x, None, x, one, 1e-6),
        "layer_norm": lambda: layer_norm.cpu(x, one, None, 1e-5),
        "layer_norm_backward": lambda: layer_norm.cpu_backward(x, x, wide, None, 1e-5),
        "mean_var": lambda: mean_var.cpu(x.t(), 0),
        "mean_var_backward": lambda: mean_var.cpu_backward(one, one, x, 1, 1),
        "gelu": lambda: gelu.cpu(x.double()),
        "gelu_backward": lambda: gelu.cpu_backward(one, x),
        "silu_mul": lambda: glu.cpu_silu_mul(x, one),
        "silu_mul_backward": lambda: glu.cpu_silu_mul_backward(x, x, one),
        "swiglu": lambda: glu.cpu_swiglu(x.t()),
        "swiglu_backward": lambda: glu.cpu_swiglu_backward(one, x),
        "rope": lambda: rope.cpu(x, cos[:1, :1], cos[:1, :1], "half"),
        "rope_backward": lambda: rope.cpu_backward(x, one, one, "half"),
    }


@pytest.mark.parametrize("name", sorted(_direct_calls()))
def test_a_kernel_called_directly_refuses_what_its_op_would_not_give_it(name) -> None:
    with pytest.raises(ValueError, match=rf"{name}: the C\+\+ kernel does not take these"):
        _direct_calls()[name]()
