"""mfusion's norm passes on real graphs: Hugging Face norm classes compiled with
``backend="spore"`` (inference and training, float32 and bfloat16), traced post-grad graphs
and dynamo's graphs (the training passes' pre-grad stage) for the forms, the refusals,
idempotence and the switches.

Tolerances against eager: float32 1e-5 (reduction order), bfloat16 2**-6 relative (the spore
ops round once where eager Llama rounds twice: at most one bfloat16 step apart, see
``test_llama_bfloat16_cast_order`` for the exact claim).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from mfusion.passes.norms import AddRMSNormPass, LayerNormPass, MeanVarPass, RMSNormPass
from mfusion.passes.norms_train import AddRMSNormTrainPass, LayerNormTrainPass, RMSNormTrainPass

H = 32
BF16 = torch.bfloat16
TOL = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-12},
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    BF16: {"atol": 2**-6, "rtol": 2**-6},
}
# weight gradients sum over rows: eager in bfloat16 steps, the spore ops in float32 rounded once
GRAD_TOL = {**TOL, BF16: {"atol": 2**-4, "rtol": 2**-4}}
RMS, ADD_RMS = "spore.rms_norm.default", "spore.add_rms_norm.default"
LN, MEAN_VAR = "spore.layer_norm.default", "spore.mean_var.default"


def _randomised(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` in ``dtype`` with random parameters (HF initialises norms to ones/zeros)."""
    module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.5)
    return module


def _close(got: Any, want: Any, dtype: torch.dtype) -> None:
    for g, w in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True
    ):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOL[dtype])


class Bundle(nn.Module):
    """Every norm the passes take, as Hugging Face and torch write them, on separate inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.llama, self.qwen2 = LlamaRMSNorm(H, eps=1e-6), Qwen2RMSNorm(H, eps=1e-5)
        self.gemma, self.t5 = GemmaRMSNorm(H, eps=1e-6), T5LayerNorm(H, eps=1e-6)
        self.ln, self.ln_no_bias = nn.LayerNorm(H), nn.LayerNorm(H, eps=1e-6, bias=False)
        self.ln_plain = nn.LayerNorm(H, elementwise_affine=False)
        self.post = LlamaRMSNorm(H)

    def forward(self, xs: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rms = [m(xs[i]) for i, m in enumerate((self.llama, self.qwen2, self.gemma, self.t5))]
        lns = [m(xs[4 + i]) for i, m in enumerate((self.ln, self.ln_no_bias, self.ln_plain))]
        stream = xs[7] + residual
        var, mean = torch.var_mean(xs[8], -1)
        last = xs[9]
        two_pass = (last.mean(-1, keepdim=True), last.var(-1, keepdim=True))
        plain = torch.nn.functional.rms_norm(xs[10], (H,), None, 1e-5)
        return (*rms, *lns, self.post(stream), stream * 2, var, mean, *two_pass, plain)


def _bundle_inputs(dtype: torch.dtype, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(11, 2, 3, H, generator=g).to(dtype).requires_grad_(grad)
    return xs, torch.randn(2, 3, H, generator=g).to(dtype).requires_grad_(grad)


@pytest.mark.parametrize(
    ("dtype", "rms_norms"),
    [(torch.float32, 5), (BF16, 4)],  # bfloat16 Gemma's float32 (1 + w) is left alone
)
def test_hf_norms_inference(mfusion_compile: Any, dtype: torch.dtype, rms_norms: int) -> None:
    model = _randomised(Bundle(), dtype)
    args = _bundle_inputs(dtype)
    with torch.no_grad():
        compiled = mfusion_compile(model, *args)
        _close(compiled.outputs, model(*args), dtype)
    assert len(compiled.graphs) == 1
    assert compiled.spore_ops() == {RMS: rms_norms, ADD_RMS: 1, LN: 3, MEAN_VAR: 2}


class Block(nn.Module):
    """A pre-norm residual block's norms and statistics, for training."""

    def __init__(self) -> None:
        super().__init__()
        self.input_norm, self.post_norm, self.ln = LlamaRMSNorm(H), LlamaRMSNorm(H), nn.LayerNorm(H)

    def forward(self, xs: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        stream = self.input_norm(xs[0]) + residual
        var, mean = torch.var_mean(xs[1], -1)
        two_pass = (xs[2].mean(-1), xs[2].var(-1))
        return self.post_norm(stream), stream, self.ln(xs[3]), var, mean, *two_pass


RMS_BWD, ADD_RMS_BWD = "spore.rms_norm_backward.default", "spore.add_rms_norm_backward.default"
LN_BWD = "spore.layer_norm_backward.default"


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_hf_norms_training(mfusion_compile: Any, dtype: torch.dtype) -> None:
    """In training the norms are rewritten before autograd (the ``*_train`` pre-grad passes):
    the forward graph holds the ops, the backward graph their backward ops; var_mean and the
    two-pass statistics fuse after autograd as in inference. Gradients equal eager's."""
    model = _randomised(Block(), dtype)
    args = _bundle_inputs(dtype, grad=True)
    eager_args = [a.detach().clone().requires_grad_() for a in args]
    compiled = mfusion_compile(model, *args)
    torch.autograd.backward(compiled.outputs, [torch.ones_like(o) for o in compiled.outputs])
    want = model(*eager_args)
    torch.autograd.backward(want, [torch.ones_like(o) for o in want])
    _close(compiled.outputs, want, dtype)
    for a, e in zip(args, eager_args, strict=True):
        torch.testing.assert_close(a.grad, e.grad, **TOL[dtype])
    assert len(compiled.graphs) == 2
    assert compiled.spore_ops(graph=0) == {RMS: 1, ADD_RMS: 1, LN: 1, MEAN_VAR: 2}
    assert compiled.spore_ops(graph=1) == {RMS_BWD: 1, ADD_RMS_BWD: 1, LN_BWD: 1}


def test_training_pass_disabled_by_name(
    mfusion_compile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MFUSION_DISABLE=rms_norm_train`` leaves training RMSNorms decomposed (the post-grad
    pass cannot take them there); the other training passes still run."""
    monkeypatch.setenv("MFUSION_DISABLE", "rms_norm_train")
    model = _randomised(Block(), torch.float32)
    args = _bundle_inputs(torch.float32, grad=True)
    compiled = mfusion_compile(model, *args)
    _close(compiled.outputs, model(*args), torch.float32)
    assert compiled.spore_ops(graph=0) == {ADD_RMS: 1, LN: 1, MEAN_VAR: 2}


def test_llama_bfloat16_cast_order(mfusion_compile: Any) -> None:
    """HF Llama rounds the normalised x to bfloat16, then multiplies by the weight. Inductor
    compiles that cast without rounding (``emulate_precision_casts`` off), i.e. one rounding:
    spore.rms_norm's contract. So the rewrite gives plain torch.compile's result (bits differ
    only through the float32 reduction order: at most one bfloat16 step, on under 1% of the
    values) and is never more than one bfloat16 step from eager's double rounding."""
    model = _randomised(LlamaRMSNorm(256), BF16)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(BF16)
    with torch.no_grad():
        compiled = mfusion_compile(model, x)
        torch._dynamo.reset()
        inductor = torch.compile(model)(x)
        eager = model(x)
    assert compiled.count(RMS) == 1
    got = compiled.outputs.float()
    step = _bf16_step(torch.maximum(got.abs(), eager.float().abs()))
    assert ((got - eager.float()).abs() <= step).all()
    differs = got != inductor.float()
    assert differs.float().mean() < 0.01
    assert ((got - inductor.float()).abs() <= step)[differs].all()


def _bf16_step(magnitude: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at ``magnitude`` (2**(exponent - 7))."""
    return torch.exp2(torch.floor(torch.log2(magnitude.clamp_min(2**-126))) - 7)


def test_disabled_by_name(mfusion_compile: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MFUSION_DISABLE", "rms_norm")
    model = _randomised(LlamaRMSNorm(H), torch.float32)
    x = torch.randn(2, 3, H)
    with torch.no_grad():
        compiled = mfusion_compile(model, x)
        _close(compiled.outputs, model(x), torch.float32)
    assert compiled.spore_ops() == {}
    assert compiled.count("aten.rsqrt.default") == 1


# Traced post-grad graphs -------------------------------------------------------------------


def _trace(fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    """``fn`` as the post-grad stage holds it: aten with Inductor's decompositions, fake
    values in ``meta["val"]``."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    with enable_python_dispatcher():
        decomposed = make_fx(fn, select_decomp_table(), tracing_mode="fake")(*args)
        functional = torch.func.functionalize(decomposed, remove="mutations")
        gm = make_fx(functional, tracing_mode="fake")(*args)
    remove_noop_ops(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    return dict(
        collections.Counter(
            str(n.target) for n in gm.graph.nodes if str(n.target).startswith("spore.")
        )
    )


def _rewritten(pass_: Any, fn: Callable[..., Any], *args: torch.Tensor) -> torch.fx.GraphModule:
    """``fn`` traced and rewritten by ``pass_``, checked against eager on ``args``."""
    gm = _trace(fn, *args)
    pass_(gm)
    gm.graph.lint()
    gm.recompile()
    dtype = args[0].dtype if args[0].is_floating_point() else torch.float32
    _close(gm(*args), fn(*args), dtype)
    return gm


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _llama(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * _rms(x).to(x.dtype)


def _gemma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (_rms(x) * (1.0 + w.float())).type_as(x)


def _squares_by_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Another spelling: ``x * x``, an integer eps added on the left, ``rsqrt * x``."""
    xf = x.float()
    return (torch.rsqrt(1 + (xf * xf).mean(dim=-1, keepdim=True)) * xf * w.float()).to(x.dtype)


def _weightless(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, 1e-5)


def _divided(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * w`` (division by the root, not the reciprocal root)."""
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def _weight_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * x * rsqrt(...)``: the weight multiplied in before the reciprocal root."""
    xf = x.float()
    return (w.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _x_times_weight_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return ((xf * w.float()) * (xf * xf).mean(-1, keepdim=True).add(1e-6).rsqrt()).to(x.dtype)


def _x_w(dtype: torch.dtype, width: int = H) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(4, 5, width, generator=g).to(dtype), torch.randn(width, generator=g).to(
        dtype
    )


@pytest.mark.parametrize(
    "fn",
    [_llama, _gemma, _squares_by_mul, _weightless, _divided, _weight_first, _x_times_weight_first],
)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rms_norm_forms(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    gm = _rewritten(RMSNormPass(), fn, *_x_w(dtype))
    expected = 0 if (fn is _gemma and dtype == BF16) else 1
    assert _ops(gm) == ({RMS: 1} if expected else {})
    if expected:
        (op,) = [n for n in gm.graph.nodes if str(n.target) == RMS]
        assert op.args[0].op == "placeholder"
        eps = {_squares_by_mul: 1.0, _weightless: 1e-5}.get(fn, 1e-6)
        assert op.args[2] == pytest.approx(eps, rel=1e-7)  # F.rms_norm rounds eps to float32


def test_norm_of_a_norm() -> None:
    """The second norm reads the first one's output, which the first rewrite replaces."""
    gm = _rewritten(RMSNormPass(), lambda x, w: _llama(_llama(x, w), w), *_x_w(torch.float32))
    assert _ops(gm) == {RMS: 2}


def test_float64_computes_in_float64() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    gm = _rewritten(RMSNormPass(), fn, *_x_w(torch.float64))
    (op,) = [n for n in gm.graph.nodes if str(n.target) == RMS]
    assert op.args[0].op == "placeholder"


def _weighted_with(eps: float) -> Callable[..., torch.Tensor]:
    return lambda x, w: w * _rms(x, eps)


def test_eps_is_read_as_given() -> None:
    for eps in (1e-6, 1e-5, 3.25e-3):
        gm = _rewritten(RMSNormPass(), _weighted_with(eps), *_x_w(torch.float32))
        (op,) = [n for n in gm.graph.nodes if str(n.target) == RMS]
        assert op.args[2] == eps


def _bf16_without_upcast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _over_dim0(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(0, keepdim=True) + 1e-6)).to(x.dtype)


def _row_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w.reshape(1, -1) * _rms(x).to(x.dtype)  # (1, H): broadcasts, but not (H,)


def _column_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w[: x.shape[-2]].reshape(-1, 1) * _rms(x).to(x.dtype)


def _rsqrt_also_returned(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return w * (xf * r).to(x.dtype), r


def _eps_outside_sqrt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf / (torch.sqrt(xf.pow(2).mean(-1, keepdim=True)) + 1e-6) * w.float()).to(x.dtype)


def _root_over_x(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) / xf * w.float()).to(x.dtype)


def _weight_product_rounded_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return ((w * x).float() * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _row_weight_first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w.reshape(1, -1) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _fp16_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w.half() * _rms(x).to(x.dtype)


@pytest.mark.parametrize(
    ("fn", "dtype"),
    [
        (_bf16_without_upcast, BF16),
        *[
            (fn, dtype)
            for fn in (_over_dim0, _row_weight, _column_weight, _rsqrt_also_returned)
            for dtype in (torch.float32, BF16)
        ],
        *[
            (fn, dtype)
            for fn in (_eps_outside_sqrt, _root_over_x)
            for dtype in (torch.float32, BF16)
        ],
        (_weight_product_rounded_first, BF16),
        (_row_weight_first, torch.float32),
    ],
)
def test_rms_norm_left_alone(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    gm = _rewritten(RMSNormPass(), fn, *_x_w(dtype))
    assert _ops(gm) == {}


def test_weight_of_another_dtype_left_alone() -> None:
    gm = _rewritten(RMSNormPass(), _fp16_weight, *_x_w(BF16))
    assert _ops(gm) == {}


def test_llama_order_left_alone_when_inductor_emulates_casts() -> None:
    from torch._inductor import config

    with config.patch(emulate_precision_casts=True):
        assert _ops(_rewritten(RMSNormPass(), _llama, *_x_w(BF16))) == {}
        assert _ops(_rewritten(RMSNormPass(), _gemma, *_x_w(torch.float32))) == {RMS: 1}


def test_integer_x_reaches_the_op_as_float() -> None:
    """An integer x is normalised after ``.float()``: the op takes the float32 tensor."""
    x = torch.randint(-5, 5, (4, 5, H), dtype=torch.int32)
    w = torch.randn(H)
    gm = _rewritten(RMSNormPass(), lambda x, w: w * _rms(x), x, w)
    (op,) = [n for n in gm.graph.nodes if str(n.target) == RMS]
    assert op.args[0].meta["val"].dtype == torch.float32


def _add_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    s = x + r
    return _llama(s, w), s.sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_add_rms_norm_keeps_the_sum(dtype: torch.dtype) -> None:
    x, w = _x_w(dtype)
    gm = _trace(_add_norm, x, x.flip(0), w)
    assert (AddRMSNormPass()(gm), RMSNormPass()(gm)) == (1, 0)
    gm.recompile()
    _close(gm(x, x.flip(0), w), _add_norm(x, x.flip(0), w), dtype)
    assert _ops(gm) == {ADD_RMS: 1}
    assert not any(str(n.target) == "aten.add.Tensor" for n in gm.graph.nodes)


def test_add_of_broadcast_left_to_rms_norm() -> None:
    x, w = _x_w(torch.float32)
    fn = lambda x, b, w: _llama(x + b, w)  # noqa: E731
    gm = _trace(fn, x, w, w)
    assert (AddRMSNormPass()(gm), RMSNormPass()(gm)) == (0, 1)


def _layer_norm(weight: bool, bias: bool) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(
            x, x.shape[-1:], w if weight else None, w.flip(0) if bias else None, 1e-5
        )

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize(("weight", "bias"), [(True, True), (True, False), (False, False)])
def test_layer_norm_forms(dtype: torch.dtype, weight: bool, bias: bool) -> None:
    gm = _rewritten(LayerNormPass(), _layer_norm(weight, bias), *_x_w(dtype))
    assert _ops(gm) == {LN: 1}
    (op,) = [n for n in gm.graph.nodes if str(n.target) == LN]
    assert [a is not None for a in op.args[1:3]] == [weight, bias]
    assert op.args[3] == 1e-5


def _centred(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` upcast and ``x - x.mean(-1, keepdim=True)``."""
    xf = x.float()
    return xf, xf - xf.mean(-1, keepdim=True)


def _ln_var_divided(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The hand-written LayerNorm: ``(x - mean) / sqrt(x.var(unbiased=False) + eps) * w + b``."""
    xf, centred = _centred(x)
    std = torch.sqrt(xf.var(-1, keepdim=True, unbiased=False) + 1e-5)
    return (centred / std * w.float() + w.flip(0).float()).to(x.dtype)


def _ln_squares_divided(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The variance as ``((x - mean)**2).mean(-1)``, the difference written twice."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = ((xf - mean) ** 2).mean(-1, keepdim=True)
    return ((xf - mean) / torch.sqrt(var + 1e-5) * w.float()).to(x.dtype)


def _ln_squares_rsqrt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``d * rsqrt((d * d).mean(-1) + eps)``, no weight, the bias added on the left."""
    _, d = _centred(x)
    return (w.flip(0).float() + torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * d).to(x.dtype)


def _ln_var_rsqrt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf, centred = _centred(x)
    return (torch.rsqrt(xf.var(-1, keepdim=True, correction=0) + 1e-5) * centred).to(x.dtype)


def _ln_var_mean_upcast_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``var_mean(x.float())`` and ``x.float() - mean``: two upcasts of x, one value."""
    var, mean = torch.var_mean(x.float(), -1, correction=0, keepdim=True)
    return ((x.float() - mean) * torch.rsqrt(var + 1e-5) * w.float()).to(x.dtype)


def _ln_squares_upcast_each_time(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The mean, the squares and the centred x each from their own ``x.float()``."""
    mean = x.float().mean(-1, keepdim=True)
    var = ((x.float() - mean) ** 2).mean(-1, keepdim=True)
    return ((x.float() - mean) / torch.sqrt(var + 1e-5) + w.flip(0).float()).to(x.dtype)


def _ln_var_upcast_twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    centred = x.float() - x.float().mean(-1, keepdim=True)
    std = torch.sqrt(x.float().var(-1, keepdim=True, unbiased=False) + 1e-5)
    return (centred / std).to(x.dtype)


@pytest.mark.parametrize(
    ("fn", "weight", "bias"),
    [
        (_ln_var_divided, True, True),
        (_ln_var_mean_upcast_twice, True, False),
        (_ln_squares_upcast_each_time, False, True),
        (_ln_var_upcast_twice, False, False),
        (_ln_squares_divided, True, False),
        (_ln_squares_rsqrt, False, True),
        (_ln_var_rsqrt, False, False),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_hand_written_layer_norm_forms(
    fn: Callable[..., Any], weight: bool, bias: bool, dtype: torch.dtype
) -> None:
    """Rewritten within the tolerances against the unfused eager form (the division by the
    root, not the op's reciprocal root, is an ulp or two apart in float32)."""
    x, w = _x_w(dtype)
    gm = _rewritten(LayerNormPass(), fn, x * 3 + 1, w)
    assert _ops(gm) == {LN: 1}
    (op,) = [n for n in gm.graph.nodes if str(n.target) == LN]
    assert [a is not None for a in op.args[1:3]] == [weight, bias]
    assert op.args[3] == 1e-5


def _ln_unbiased_var(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf, centred = _centred(x)
    return (centred / torch.sqrt(xf.var(-1, keepdim=True) + 1e-5) * w.float()).to(x.dtype)


def _ln_eps_outside_sqrt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf, centred = _centred(x)
    std = torch.sqrt(xf.var(-1, keepdim=True, unbiased=False)) + 1e-5
    return (centred / std * w.float()).to(x.dtype)


def _ln_row_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _, centred = _centred(x)
    var = (centred**2).mean(-1, keepdim=True)
    return (centred / torch.sqrt(var + 1e-5) * w.reshape(1, -1).float()).to(x.dtype)


def test_hand_written_layer_norm_keeps_a_row_weight_outside() -> None:
    """A ``(1, width)`` weight is not the op's: float32 rewrites the norm alone (the product
    stays after it, as eager computes it); bfloat16, whose product comes before the one
    rounding, is left alone (in ``test_hand_written_layer_norm_left_alone``)."""
    x, w = _x_w(torch.float32)
    gm = _rewritten(LayerNormPass(), _ln_row_weight, x * 3 + 1, w)
    (op,) = [n for n in gm.graph.nodes if str(n.target) == LN]
    assert op.args[1:3] == (None, None)
    assert [str(u.target) for u in op.users] == ["aten.mul.Tensor"]


def _ln_squares_of_other_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The squared deviation from another tensor's mean: not x's variance."""
    xf, centred = _centred(x)
    var = ((xf - xf.flip(0).mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
    return (centred / torch.sqrt(var + 1e-5)).to(x.dtype)


def _ln_16_bit_statistics(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * w


def _ln_var_over_dim0(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf, centred = _centred(x)
    return (centred / torch.sqrt(xf.var(0, keepdim=True, unbiased=False) + 1e-5)).to(x.dtype)


def _ln_centred_also_returned(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    _, centred = _centred(x)
    var = (centred**2).mean(-1, keepdim=True)
    return (centred / torch.sqrt(var + 1e-5)).to(x.dtype), centred


@pytest.mark.parametrize(
    ("fn", "dtype"),
    [
        *[
            (fn, dtype)
            for fn in (
                _ln_unbiased_var,
                _ln_eps_outside_sqrt,
                _ln_squares_of_other_mean,
                _ln_var_over_dim0,
                _ln_centred_also_returned,
            )
            for dtype in (torch.float32, BF16)
        ],
        (_ln_row_weight, BF16),
        (_ln_16_bit_statistics, BF16),
    ],
)
def test_hand_written_layer_norm_left_alone(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    x, w = _x_w(dtype)
    gm = _rewritten(LayerNormPass(), fn, x * 3 + 1, w)
    assert _ops(gm) == {}


def _unbiased_layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=1)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w


def _layer_norm_over_dim0(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, 0, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + 1e-5)


def _layer_norm_saving_mean(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + 1e-5) * w, mean


@pytest.mark.parametrize(
    "fn", [_unbiased_layer_norm, _layer_norm_over_dim0, _layer_norm_saving_mean]
)
def test_layer_norm_left_alone(fn: Callable[..., Any]) -> None:
    gm = _rewritten(LayerNormPass(), fn, *_x_w(torch.float32))
    assert _ops(gm) == {}
    assert MeanVarPass()(gm) == 0  # LayerNorm statistics stay with Inductor's fused kernel


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.var_mean(x, -1),
        lambda x: torch.var_mean(x, 1, keepdim=True, correction=0),
        lambda x: torch.var_mean(x, dim=0, correction=2),
        lambda x: (x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)),
        lambda x: (x.mean(1), x.var(1).sqrt()),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_mean_var_forms(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    gm = _rewritten(MeanVarPass(), fn, _x_w(dtype)[0])
    assert _ops(gm) == {MEAN_VAR: 1}


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.var_mean(x, [0, 1]),  # two dimensions
        lambda x: (x.mean(-1), x.var(0)),  # other dimensions
        lambda x: (x.mean(-1, keepdim=True), x.var(-1)),  # keepdim differs
        lambda x: (x.mean(-1), x.flip(0).var(-1)),  # other tensors
        lambda x: torch.var_mean(x, -1, correction=0.5),  # a fractional correction
        lambda x: (x.mean(1), x.std(1)),  # bfloat16 std: the var of an upcast x
    ],
)
def test_mean_var_left_alone(fn: Callable[..., Any]) -> None:
    gm = _rewritten(MeanVarPass(), fn, _x_w(BF16)[0])
    assert _ops(gm) == {}


def test_every_pass_is_idempotent() -> None:
    model = _randomised(Bundle(), torch.float32)
    params = dict(model.named_parameters())
    args = _bundle_inputs(torch.float32)
    gm = _trace(lambda p, xs, r: torch.func.functional_call(model, p, (xs, r)), params, *args)
    passes = (AddRMSNormPass(), RMSNormPass(), LayerNormPass(), MeanVarPass())
    assert [p(gm) for p in passes] == [1, 5, 3, 2]
    gm.recompile()
    code = gm.code
    assert [p(gm) for p in passes] == [0, 0, 0, 0]
    gm.recompile()
    assert gm.code == code
    with torch.no_grad():
        _close(gm(params, *args), model(*args), torch.float32)


# Dynamo graphs (the pre-grad stage) ---------------------------------------------------------


def _dynamo_graph(
    fn: Callable[..., Any], *args: Any, dynamic: bool | None = None
) -> tuple[torch.fx.GraphModule, list]:
    """``fn``'s graph as dynamo hands it to a backend (Inductor's pre-grad stage sees it so),
    and the real tensors it takes (parameters included)."""
    captured = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    ((gm, inputs),) = captured
    return gm, inputs


TRAIN_PASSES = (AddRMSNormTrainPass(), RMSNormTrainPass(), LayerNormTrainPass())


class Training(nn.Module):
    """The norms the training passes take, on separate inputs, and a residual stream."""

    def __init__(self) -> None:
        super().__init__()
        self.llama, self.qwen2 = LlamaRMSNorm(H, eps=1e-6), Qwen2RMSNorm(H, eps=1e-5)
        self.gemma, self.t5 = GemmaRMSNorm(H, eps=1e-6), T5LayerNorm(H, eps=1e-6)
        self.ln, self.ln_plain = nn.LayerNorm(H), nn.LayerNorm(H, elementwise_affine=False)
        self.rms, self.post = nn.RMSNorm(H, eps=1e-5), LlamaRMSNorm(H)
        self.rms_default = nn.RMSNorm(H)  # eps=None: float32's epsilon, also for bfloat16

    def forward(self, xs: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        norms = (self.llama, self.qwen2, self.gemma, self.t5, self.ln, self.ln_plain, self.rms)
        stream = self.llama(xs[7]) + residual
        small = self.rms_default(xs[8] * 0.01)  # a mean square near eps: a wrong eps shows
        return (*(m(xs[i]) for i, m in enumerate(norms)), self.post(stream), stream * 2, small)


def _grads(outputs: Any, wrt: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    outputs = torch.utils._pytree.tree_leaves(outputs)
    weights = [torch.randn(o.shape, generator=torch.Generator().manual_seed(3)) for o in outputs]
    total = sum((o.float() * w).sum() for o, w in zip(outputs, weights, strict=True))
    return torch.autograd.grad(total, wrt)


@pytest.mark.parametrize(
    ("dtype", "rms_norms"),
    [(torch.float32, 7), (BF16, 6)],  # bfloat16 Gemma's float32 (1 + w) is left alone
)
def test_training_passes_on_dynamo_graph(dtype: torch.dtype, rms_norms: int) -> None:
    """Every form → its op in dynamo's graph; run eagerly, the rewritten graph's outputs and
    gradients (through the ops' registered backward) equal the module's."""
    model = _randomised(Training(), dtype)
    args = _bundle_inputs(dtype, grad=True)
    gm, inputs = _dynamo_graph(model, *args)
    assert [p(gm) for p in TRAIN_PASSES] == [1, rms_norms, 2]
    gm.graph.lint()
    gm.recompile()
    assert _ops(gm) == {ADD_RMS: 1, RMS: rms_norms, LN: 2}
    eps = [n.args[2] for n in gm.graph.nodes if str(n.target) == RMS]
    assert torch.finfo(torch.float32).eps in eps  # nn.RMSNorm's eps=None (was left alone)
    wrt = [t for t in inputs if t.requires_grad]
    got, want = gm(*inputs), model(*args)
    _close(got, want, dtype)
    for g, e in zip(_grads(got, wrt), _grads(want, wrt), strict=True):
        torch.testing.assert_close(g, e, **GRAD_TOL[dtype])
    code = gm.code
    assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]
    gm.recompile()
    assert gm.code == code


def test_training_passes_leave_inference_alone() -> None:
    """Without grad the graph is left to the post-grad passes."""
    model = _randomised(Training(), torch.float32)
    with torch.no_grad():
        gm, _ = _dynamo_graph(model, *_bundle_inputs(torch.float32))
    assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]


def _one_sum_two_norms(
    a: torch.Tensor, b: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    total = a + b
    return _llama(total, w1), _llama(total, w2), total


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_training_sum_read_by_two_norms(dtype: torch.dtype) -> None:
    """The first norm's rewrite replaces the sum by add_rms_norm's; the second was still
    taken for a plain sum and got that op's (result, sum) tuple as x: the compile failed."""
    g = torch.Generator().manual_seed(5)
    args = [torch.randn(4, 5, H, generator=g).to(dtype).requires_grad_() for _ in range(2)]
    args += [torch.randn(H, generator=g).to(dtype).requires_grad_() for _ in range(2)]
    gm, inputs = _dynamo_graph(_one_sum_two_norms, *args)
    assert [p(gm) for p in TRAIN_PASSES] == [1, 1, 0]
    gm.recompile()
    assert _ops(gm) == {ADD_RMS: 1, RMS: 1}
    got, want = gm(*inputs), _one_sum_two_norms(*args)
    _close(got, want, dtype)
    for g, e in zip(_grads(got, args), _grads(want, args), strict=True):
        torch.testing.assert_close(g, e, **GRAD_TOL[dtype])


def test_training_llama_order_left_alone_when_inductor_emulates_casts() -> None:
    """The training passes read dynamo's ``example_value``; the check looked at ``val`` only
    and rewrote the bf16 Llama form that inference leaves to Inductor under this flag."""
    from torch._inductor import config

    x, w = (t.requires_grad_() for t in _x_w(BF16))
    gm, _ = _dynamo_graph(_llama, x, w)
    with config.patch(emulate_precision_casts=True):
        assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]


@pytest.mark.parametrize("grad", [False, True])
def test_zero_dim_norm_forms_left_alone(grad: bool) -> None:
    """``mean(-1)`` is legal on a 0-d tensor; the matchers indexed its empty shape."""

    def norms(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        return w * _rms(x), (x - mean) * torch.rsqrt(var + 1e-5) * w

    x = torch.tensor(3.0, requires_grad=grad)
    w = torch.tensor(2.0, requires_grad=grad)
    for pass_ in (RMSNormPass(), LayerNormPass(), MeanVarPass()):
        assert _ops(_rewritten(pass_, norms, x.detach(), w.detach())) == {}
    gm, _ = _dynamo_graph(norms, x, w)
    assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]


def _mutated_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """T5's form with its x changed in place between the statistics and the product."""
    h = x * 1.0
    variance = h.pow(2).mean(-1, keepdim=True)
    h.mul_(2.0)
    return w * (h * torch.rsqrt(variance + 1e-6))


def _set_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``h[..., 0] = v`` between the statistics and the product (dynamo: operator.setitem)."""
    h = x * 1.0
    variance = h.pow(2).mean(-1, keepdim=True)
    h[..., 0] = 100.0
    return w * (h * torch.rsqrt(variance + 1e-6))


def _iadd_of_an_alias_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x * 1.0
    variance = h.pow(2).mean(-1, keepdim=True)
    alias = h
    alias += 100.0  # dynamo: operator.iadd
    return w * (h * torch.rsqrt(variance + 1e-6))


def _set_between_add_and_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = x + x.sin()
    total[..., 0] = 0.0
    return w * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))


def _upcast_rms(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _changed_after_the_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x changed in place after its norm: eager's bf16 norm saved a float32 copy, the op would
    save x itself (autograd then refuses the backward)."""
    h = x * 1.0
    y = _upcast_rms(h, w)
    h.mul_(2.0)
    return y * h


def _sum_changed_after_the_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    total = x + x.sin()
    y = _upcast_rms(total, w)
    total.view(-1)[0] = 0.0  # through a view of it
    return y * total


def _base_changed_after_the_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The norm of a view of h, then h changed in place: the write reaches the view (the pass
    followed only views taken of the norm's input, and autograd refused the backward)."""
    h = x * 1.0
    y = _upcast_rms(h[0], w)
    h.mul_(2.0)
    return y * h[0]


_ALIASES = {  # views by other names than the usual (the pass knew aliases by a list of names)
    "T": lambda h: h.T,
    "unfold": lambda h: h.unfold(0, 1, 1),
    "ravel": lambda h: h.ravel(),
    "tensor_split": lambda h: h.tensor_split(2)[0],
}


def _changed_through(alias: str) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x * 1.0
        y = _upcast_rms(h, w)
        _ALIASES[alias](h).mul_(2.0)
        return y * h

    fn.__name__ = f"_changed_through_{alias}"
    return fn


def _functional_changed_after_the_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.rms_norm's x changed in place after it: the op would save x (no check was made)."""
    h = x * 1.0
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), w, 1e-6)
    h.mul_(2.0)
    return y * h


def _weight_from_the_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The norm's weight computed from the residual sum it normalises, before the norm."""
    total = x + x.sin()
    weight = total[0, 0]
    return total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


@pytest.mark.parametrize("grad", [False, True])
def test_a_weight_computed_from_the_sum_leaves_it_to_rms_norm(grad: bool) -> None:
    """add_rms_norm put its op after the weight and gave the weight the op's sum: a cycle
    (``graph.lint``: used before defined). rms_norm takes the form instead."""
    x, w = _x_w(torch.float32)
    if grad:
        x.requires_grad_()
        gm, inputs = _dynamo_graph(_weight_from_the_sum, x, w)
        assert [p(gm) for p in TRAIN_PASSES] == [0, 1, 0]
    else:
        gm, inputs = _trace(_weight_from_the_sum, x, w), [x, w]
        assert AddRMSNormPass()(gm) == 0
    gm.graph.lint()
    gm.recompile()
    _close(gm(*inputs), _weight_from_the_sum(x, w), torch.float32)


def _gemma_add(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gemma's order: ``1 + w`` computed after the statistics of the sum; the sum read after."""
    h = a + b
    return _gemma(h, w), h * 2


def _gemma_add_sum_read_first(
    a: torch.Tensor, b: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The sum read outside the norm before ``1 + w``: the op cannot go after the weight."""
    h = a + b
    first = h * 2
    return _gemma(h, w), first


def _upcast_of_sum_returned(
    a: torch.Tensor, b: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The sum's upcast, which the norm reads before its weight ``w * 2``, also an output."""
    hf = (a + b).float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (normed * (w * 2).float()).to(a.dtype), hf


@pytest.mark.parametrize(
    ("fn", "dtype", "fused"),
    [
        (_gemma_add, torch.float32, True),
        (_gemma_add_sum_read_first, torch.float32, False),
        (_upcast_of_sum_returned, BF16, False),
    ],
)
def test_add_rms_norm_with_the_weight_computed_after_the_sum(
    fn: Callable[..., Any], dtype: torch.dtype, fused: bool
) -> None:
    """The norm's own nodes read the sum before the weight: they were counted as other users
    and the form was left to rms_norm. A node outside the norm that reads the sum (or its
    upcast) before the weight still leaves it there."""
    x, w = _x_w(dtype)
    gm = _trace(fn, x, x.flip(0), w)
    assert (AddRMSNormPass()(gm), RMSNormPass()(gm)) == ((1, 0) if fused else (0, 1))
    gm.graph.lint()
    gm.recompile()
    _close(gm(x, x.flip(0), w), fn(x, x.flip(0), w), dtype)


def test_training_gemma_add_rms_norm() -> None:
    """In training, Gemma's Add+RMSNorm (``GemmaRMSNorm`` of a residual sum) → add_rms_norm."""
    norm = _randomised(GemmaRMSNorm(H, eps=1e-6), torch.float32)

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = a + b
        return norm(h), h * 2

    g = torch.Generator().manual_seed(6)
    a, b = (torch.randn(4, 5, H, generator=g).requires_grad_() for _ in range(2))
    gm, inputs = _dynamo_graph(fn, a, b)
    assert [p(gm) for p in TRAIN_PASSES] == [1, 0, 0]
    gm.graph.lint()
    gm.recompile()
    wrt = [t for t in inputs if t.requires_grad]
    got, want = gm(*inputs), fn(a, b)
    _close(got, want, torch.float32)
    for g, e in zip(_grads(got, wrt), _grads(want, wrt), strict=True):
        torch.testing.assert_close(g, e, **GRAD_TOL[torch.float32])


def _read_after_the_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x read (not written) after its norm, by ops whose first argument is a list."""
    h = x * 1.0
    y = _upcast_rms(h, w)
    return torch.cat([y, h]) + torch.stack([h, y]).sum(0).repeat(2, 1, 1)


def test_a_norm_whose_input_is_only_read_later_is_rewritten() -> None:
    x, w = (t.requires_grad_() for t in _x_w(BF16))
    gm, inputs = _dynamo_graph(_read_after_the_norm, x, w)
    assert [p(gm) for p in TRAIN_PASSES] == [0, 1, 0]
    _close(gm(*inputs), _read_after_the_norm(x, w), BF16)


def _and_between(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a & b`` (dynamo: operator.and_, out of place) between the statistics and the product,
    as HF Llama's mask before its first norm with use_cache=False."""
    h = x * 1.0
    variance = h.pow(2).mean(-1, keepdim=True)
    inside = (h > 0) & (h < 1) | (h > 2)
    return w * (h * torch.rsqrt(variance + 1e-6)) * inside


def test_an_out_of_place_operator_between_a_norm_s_nodes_is_no_write() -> None:
    """and_ and or_ end in '_', which Inductor's is_mutation_op takes for in place: the
    training passes left the norm alone."""
    x, w = (t.requires_grad_() for t in _x_w(torch.float32))
    gm, inputs = _dynamo_graph(_and_between, x, w)
    assert [p(gm) for p in TRAIN_PASSES] == [0, 1, 0]
    (got,) = gm(*inputs)
    _close(got, _and_between(x, w), torch.float32)


def _layer_norm_two_dims(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-2:])


def _layer_norm_fp32_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w.float())


@pytest.mark.parametrize(
    ("fn", "dtype"),
    [
        (_mutated_between, torch.float32),
        (_set_between, torch.float32),
        (_iadd_of_an_alias_between, torch.float32),
        (_set_between_add_and_norm, torch.float32),
        (_changed_after_the_norm, BF16),
        (_sum_changed_after_the_norm, BF16),
        (_base_changed_after_the_norm, BF16),
        *((_changed_through(alias), BF16) for alias in _ALIASES),
        (_functional_changed_after_the_norm, torch.float32),
        (_functional_changed_after_the_norm, BF16),
        (_layer_norm_two_dims, torch.float32),
        (_layer_norm_fp32_weight, BF16),
    ],
)
def test_training_forms_left_alone(fn: Callable[..., Any], dtype: torch.dtype) -> None:
    x, w = (t.requires_grad_() for t in _x_w(dtype))
    gm, inputs = _dynamo_graph(fn, x, w)
    assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]
    (got,) = gm(*inputs)  # dynamo's graph returns a tuple
    want = fn(x, w)
    _close(got, want, dtype)
    # the backward runs where eager's does (an op saving a tensor changed since would refuse)
    assert _backward_runs(got) == _backward_runs(want)


def _backward_runs(out: torch.Tensor) -> bool:
    try:
        out.float().sum().backward()
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        return False
    return True


def _shaped_by_x(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.nn.functional.layer_norm(x, x.shape[-1:], w),
        torch.nn.functional.rms_norm(x, x.shape[-1:], w, 1e-6),
    )


def test_training_norm_shaped_by_a_symbolic_size_is_left_alone(mfusion_compile: Any) -> None:
    """``layer_norm(x, x.shape[-1:])`` with a dynamic row: the shape is a node (the pass failed
    the compile with "'Node' object is not iterable")."""
    x, w = (t.requires_grad_() for t in _x_w(torch.float32))
    gm, _ = _dynamo_graph(_shaped_by_x, x, w, dynamic=True)
    assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]
    torch._dynamo.reset()
    dynamic_x = x.detach().clone().requires_grad_()
    torch._dynamo.mark_dynamic(dynamic_x, 1)
    compiled = mfusion_compile(_shaped_by_x, dynamic_x, w)
    _close(compiled.outputs, _shaped_by_x(x, w), torch.float32)


def test_weightless_norms_with_a_dynamic_row_compile(mfusion_compile: Any) -> None:
    """Their ones had a raw SymInt for a size (Inductor failed to lower ``aten.full``); a
    weightless add + RMSNorm with a dynamic row is left to the RMSNorm pass."""

    def fn(x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + r
        return _rms(x), _rms(total)

    x, r = torch.randn(4, 24), torch.randn(4, 24)
    torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.mark_dynamic(r, 1)
    with torch.no_grad():
        compiled = mfusion_compile(fn, x, r)
    _close(compiled.outputs, fn(x, r), torch.float32)
    assert compiled.spore_ops() == {RMS: 2}


class TorchAndHandWritten(nn.Module):
    """PyTorch's own ``nn.RMSNorm`` (``F.rms_norm``) and two hand-written spellings."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.w1, self.w2 = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))

    def forward(self, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.norm(xs[0]), _weight_first(xs[1], self.w1), _divided(xs[2], self.w2)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_torch_rms_norm_and_spellings_compiled(mfusion_compile: Any, dtype: torch.dtype) -> None:
    """Inference rewrites all three; in training ``nn.RMSNorm`` and the weight-first form are
    rewritten before autograd (the division form stays decomposed there, README Limits).
    Outputs and gradients equal eager's."""
    model = _randomised(TorchAndHandWritten(), dtype)
    xs = torch.randn(3, 2, 5, H, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        compiled = mfusion_compile(model, xs)
        _close(compiled.outputs, model(xs), dtype)
    assert compiled.spore_ops() == {RMS: 3}
    torch._dynamo.reset()
    eager_model = copy.deepcopy(model)
    leaf, eager_leaf = xs.clone().requires_grad_(), xs.clone().requires_grad_()
    trained = mfusion_compile(model, leaf)
    want = eager_model(eager_leaf)
    upstream = [torch.randn(w.shape).to(dtype) for w in want]
    torch.autograd.backward(trained.outputs, upstream)
    torch.autograd.backward(want, upstream)
    _close(trained.outputs, want, dtype)
    torch.testing.assert_close(leaf.grad, eager_leaf.grad, **GRAD_TOL[dtype])
    for p, e in zip(model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, e.grad, **GRAD_TOL[dtype])
    assert trained.spore_ops(graph=0) == {RMS: 2}


class HandWrittenLayerNorms(nn.Module):
    """Two hand-written LayerNorms (``x.var(unbiased=False)``, ``((x - mean)**2).mean()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.ones(H)), nn.Parameter(torch.zeros(H))
        self.w2 = nn.Parameter(torch.ones(H))

    def forward(self, xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, dtype = xs[0].float(), xs.dtype
        centred = x - x.mean(-1, keepdim=True)
        std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
        first = (centred / std * self.w1.float() + self.b1.float()).to(dtype)
        return first, _ln_squares_divided(xs[1], self.w2)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_hand_written_layer_norms_compiled(mfusion_compile: Any, dtype: torch.dtype) -> None:
    """Inference rewrites both (their statistics no longer become ``spore.mean_var``); the
    outputs equal the unfused eager module's."""
    model = _randomised(HandWrittenLayerNorms(), dtype)
    xs = (3 * torch.randn(2, 2, 5, H, generator=torch.Generator().manual_seed(4)) + 1).to(dtype)
    with torch.no_grad():
        compiled = mfusion_compile(model, xs)
        _close(compiled.outputs, model(xs), dtype)
    assert compiled.spore_ops() == {LN: 2}


BAD_EPS = [-1e-6, float("nan"), float("inf")]


def _rms_eps(eps: float) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * _rms(x, eps)

    return fn


def _layer_norm_eps(eps: float) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, x.shape[-1:], w, w.flip(0), eps)

    return fn


@pytest.mark.parametrize("eps", BAD_EPS)
def test_eps_the_ops_refuse_left_alone(eps: float) -> None:
    """A negative, NaN or infinite eps is computed by eager; the spore ops raise on it, so a
    rewrite made the compiled graph fail (``rms_norm: eps must be a finite number >= 0``)."""
    x, w = _x_w(torch.float32)
    for pass_, fn in ((RMSNormPass(), _rms_eps(eps)), (LayerNormPass(), _layer_norm_eps(eps))):
        gm = _trace(fn, x, w)
        assert pass_(gm) == 0
        gm.recompile()
        torch.testing.assert_close(gm(x, w), fn(x, w), equal_nan=True)
    total = _trace(lambda a, b, w: _rms_eps(eps)(a + b, w), x, x, w)
    assert AddRMSNormPass()(total) == 0


@pytest.mark.parametrize("eps", BAD_EPS)
def test_training_eps_the_ops_refuse_left_alone(eps: float) -> None:
    """The training passes: ``F.rms_norm``, ``F.layer_norm`` and the hand-written form."""

    def norms(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        functional = torch.nn.functional
        return (
            functional.rms_norm(x, x.shape[-1:], w, eps),
            _layer_norm_eps(eps)(x, w),
            _rms_eps(eps)(x, w),
        )

    x, w = (t.requires_grad_() for t in _x_w(torch.float32))
    gm, _ = _dynamo_graph(norms, x, w)
    assert [p(gm) for p in TRAIN_PASSES] == [0, 0, 0]
