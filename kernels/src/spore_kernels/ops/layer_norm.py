"""``layer_norm(x, weight, bias, eps)`` over the last dimension, and its backward.

Like ``F.layer_norm(x, x.shape[-1:], weight, bias, eps)``; weight and bias are optional.
Numerics contract: float32 statistics whatever the input dtype (float64 stays float64), two-pass
per row (the mean, then the mean squared deviation from it: the biased variance); normalise,
multiply by the weight and add the bias in float32, rounded once to x's dtype.
Backward: ``layer_norm_backward(grad, x, weight, bias, eps) -> (dx, dweight, dbias)``, closed
form with float32 accumulation, statistics recomputed from x (forward saves only its inputs);
``dweight`` is None without a weight, ``dbias`` None without a bias (the bias itself is only
read for its dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from spore_kernels import _checks, _lib

SCHEMA = "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor"
BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor?, Tensor?)"
)


def _present(weight: torch.Tensor | None, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return {name: t for name, t in (("weight", weight), ("bias", bias)) if t is not None}


def check(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """Clear errors for the inputs layer_norm cannot take."""
    params = _present(weight, bias)
    _checks.floating("layer_norm", x=x, **params)
    if x.dim() < 1:
        raise ValueError("layer_norm needs x with at least one dimension")
    for name, t in params.items():
        if t.shape != x.shape[-1:]:
            raise ValueError(
                f"layer_norm {name} must have shape {tuple(x.shape[-1:])} (x's last dimension), "
                f"got {tuple(t.shape)}"
            )
    _checks.same_device("layer_norm", x=x, **params)


def check_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> None:
    """The forward's errors for x, weight and bias, and grad of the output's shape and a float."""
    check(x, weight, bias)
    _checks.upstream("layer_norm_backward", x.shape, grad=grad)


def _normalised(xf: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x - mean) and rstd over the last dimension (biased variance, two-pass, x centred twice
    as in the C++ kernel)."""
    centred = _checks.centred(xf, -1)
    return centred, torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)


def reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    check(x, weight, bias)
    _checks.epsilon("layer_norm", eps)
    compute = _checks.compute_dtype(x)
    centred, rstd = _normalised(x.to(compute), eps)
    out = centred * rstd
    if weight is not None:
        out = out * weight.to(compute)
    if bias is not None:
        out = out + bias.to(compute)
    return out.to(x.dtype)


def reference_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The closed form: dx = rstd * (gw - mean(gw) - xhat * mean(gw*xhat)), gw = g*w,
    dweight = sum of g*xhat, dbias = sum of g; dx contiguous."""
    check_backward(grad, x, weight, bias)
    _checks.epsilon("layer_norm_backward", eps)
    compute = _checks.compute_dtype(x)
    gf = grad.to(compute)
    centred, rstd = _normalised(x.to(compute), eps)
    xhat = centred * rstd
    gw = gf if weight is None else gf * weight.to(compute)
    dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = None if weight is None else _checks.column_sums(gf * xhat).to(weight.dtype)
    db = None if bias is None else _checks.column_sums(gf).to(bias.dtype)
    return dx.to(x.dtype).contiguous(), dw, db


def supports(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> bool:
    """Contiguous CPU tensors of one kernel dtype, weight and bias (if any) like x's rows, a
    valid eps."""
    params = list(_present(weight, bias).values())
    return (
        _checks.ready(x, *params, device_type="cpu")
        and _checks.valid_eps(eps)
        and x.dim() >= 1
        and x.shape[-1] > 0
        and all(t.shape == x.shape[-1:] for t in params)
    )


def supports_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> bool:
    return (
        supports(x, weight, bias, eps)
        and _checks.ready(grad, x, device_type="cpu")
        and grad.shape == x.shape
    )


_FWD = (*(_lib.ptr,) * 4, _lib.i64, _lib.i64, _lib.f32, _lib.i32, _lib.i32)
_BWD = (*(_lib.ptr,) * 6, _lib.i64, _lib.i64, _lib.f32, _lib.i32, _lib.i32)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _cpu(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    rows, cols = _checks.rows_cols(x)
    ptrs = (x.data_ptr(), _ptr(weight), _ptr(bias), y.data_ptr())
    _lib.call(
        "spore_layer_norm", _FWD, *ptrs, rows, cols, float(eps), _lib.dtype_code(x), _lib.threads()
    )
    return y


def _cpu_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    cols = x.shape[-1]
    dx = torch.empty_like(x)
    dw = None if weight is None else torch.zeros_like(weight)
    db = None if bias is None else torch.zeros_like(bias)
    if x.numel() == 0:
        return dx, dw, db
    rows, _ = _checks.rows_cols(x)
    ptrs = (grad.data_ptr(), x.data_ptr(), _ptr(weight), dx.data_ptr(), _ptr(dw), _ptr(db))
    args = (*ptrs, rows, cols, float(eps), _lib.dtype_code(x), _lib.threads())
    _lib.call("spore_layer_norm_backward", _BWD, *args)
    return dx, dw, db


def _fake_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    check_backward(grad, x, weight, bias)
    _checks.epsilon("layer_norm_backward", eps)
    dw = None if weight is None else torch.empty_like(weight)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, dw, (None if bias is None else torch.empty_like(bias))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.eps = eps


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.spore.layer_norm_backward(grad.contiguous(), x, weight, bias, ctx.eps)
    return dx, dw, db, None


cpu = _checks.direct("layer_norm", _cpu, supports)


cpu_backward = _checks.direct("layer_norm_backward", _cpu_backward, supports_backward)


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define(
        "layer_norm_backward", BACKWARD_SCHEMA, reference=reference_backward, fake=_fake_backward
    )
    registry.kernel(
        bwd, "cpu", _cpu_backward, priority=_checks.PRIORITY, supports=supports_backward
    )
    fwd = registry.define(
        "layer_norm", SCHEMA, reference=reference, backward=_backward, setup_context=_setup_context
    )
    registry.kernel(fwd, "cpu", _cpu, priority=_checks.PRIORITY, supports=supports)


EPS = 1e-5


def composite(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """What a user writes: (x - mean) / sqrt(var + eps) * w + b, computed in float32."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = xf.var(-1, keepdim=True, correction=0)
    return ((xf - mean) / torch.sqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    def make(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        x = torch.randn(8192, 4096, generator=g).to(dtype)
        return x, torch.randn(4096, generator=g).to(dtype), torch.randn(4096, generator=g).to(dtype)

    return [
        OpBench(
            op="layer_norm",
            shape="8192x4096",
            make=make,
            spore=lambda x, w, b: torch.ops.spore.layer_norm(x, w, b, EPS),
            baselines={
                "eager": ("eager composite (x - mean) / sqrt(var + eps) * w + b", composite),
                "F.layer_norm": (
                    "torch.nn.functional.layer_norm",
                    lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS),
                ),
            },
            differentiable=(0, 1, 2),
            inexact={
                ("F.layer_norm", "fwdbwd-bf16"): (
                    "not checked: torch's CPU bf16 layer_norm backward sums the weight and bias "
                    "gradients in bf16 (dbias 512 instead of 8192 for ones)"
                )
            },
        )
    ]
