"""``mean_var(x, dim, correction=1) -> (mean, var)`` over one dimension, and its backward.

Like ``torch.var_mean(x, dim, correction=correction)`` with the outputs swapped: the reduced
dimension is removed, outputs have x's dtype, the divisor is ``max(n - correction, 0)`` (so
``n - correction <= 0`` gives inf or NaN like torch), an empty dimension gives NaN, and an
infinite value gives a NaN mean and variance (Welford; torch.var_mean does the same).
Numerics contract: float32 whatever the input dtype (float64 stays float64), each output
rounded once to x's dtype. The kernel is one-pass Welford: independent Welford states (per SIMD
lane over the dimension when it is the last one, per column otherwise) of at most 128 steps,
combined with the parallel merge of Chan et al. — pairwise across segments, then across the
parts of the dimension that threads share when there are fewer rows than threads; about one
float32 rounding of error even for millions of values.
Backward: ``mean_var_backward(grad_mean, grad_var, x, dim, correction) -> dx`` with
``dx = grad_mean / n + grad_var * 2 (x - mean) / (n - correction)``, the mean recomputed from x
(float32 sums per segment, float64 across segments; forward saves only x); a missing upstream
gradient counts as zero. Over the last dimension each row is read once from memory (the second
pass hits cache); over another dimension x is read twice (sums, then gradients).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spore_kernels import _checks, _lib

SCHEMA = "(Tensor x, int dim, int correction=1) -> (Tensor, Tensor)"
BACKWARD_SCHEMA = (
    "(Tensor? grad_mean, Tensor? grad_var, Tensor x, int dim, int correction) -> Tensor"
)


def check(x: torch.Tensor, dim: int, correction: int) -> None:
    """Clear errors for the inputs mean_var cannot take."""
    _checks.floating("mean_var", x=x)
    rank = max(x.dim(), 1)
    if not -rank <= dim < rank:
        raise IndexError(
            f"mean_var: dim {dim} is out of range for a {x.dim()}-dimensional x; "
            f"use a dim in [{-rank}, {rank - 1}]"
        )
    if correction < 0:
        raise ValueError(
            f"mean_var: correction must be >= 0 (0: biased, 1: Bessel), got {correction}"
        )


def _split(shape: torch.Size, dim: int) -> tuple[int, int, int, list[int]]:
    """(outer, n, inner) of x viewed around ``dim``, and the output shape (``dim`` removed)."""
    d = dim % len(shape)
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1 :])
    return outer, shape[d], inner, [*shape[:d], *shape[d + 1 :]]


def reference(x: torch.Tensor, dim: int, correction: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    check(x, dim, correction)
    var, mean = torch.var_mean(x.to(_checks.compute_dtype(x)), dim, correction=correction)
    return mean.to(x.dtype), var.to(x.dtype)


def _check_upstream(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> None:
    check(x, dim, correction)
    shape = _split(x.shape, dim)[3] if x.dim() else []
    _checks.upstream("mean_var_backward", shape, grad_mean=grad_mean, grad_var=grad_var)


def reference_backward(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> torch.Tensor:
    """The closed form: dx = grad_mean / n + grad_var * 2 (x - mean) / (n - correction); where
    n == correction a zero grad_var (an unused variance, as compiled graphs pass it) adds 0."""
    _check_upstream(grad_mean, grad_var, x, dim, correction)
    compute = _checks.compute_dtype(x)
    dx = torch.zeros_like(x, dtype=compute)
    if x.numel() == 0:
        return dx.to(x.dtype)
    xf = x.to(compute)
    n = x.shape[dim] if x.dim() else 1

    def spread(g: torch.Tensor) -> torch.Tensor:
        return g.to(compute).unsqueeze(dim) if x.dim() else g.to(compute)

    if grad_mean is not None:
        dx = dx + spread(grad_mean) / n
    if grad_var is not None:
        dof = n - correction
        coef = spread(grad_var) * (2.0 / dof if dof else math.inf)
        if not dof:  # 0 * inf: a zero gradient (the variance unused) adds nothing, not NaN
            coef = torch.where(spread(grad_var) == 0, 0.0, coef)
        dx = dx + coef * _checks.centred(xf, dim)
    return dx.to(x.dtype)


def supports(x: torch.Tensor, dim: int, correction: int = 1) -> bool:
    """Contiguous CPU x of a kernel dtype, at least 1-D, with a valid dim and correction."""
    return (
        _checks.ready(x, device_type="cpu")
        and x.dim() >= 1
        and -x.dim() <= dim < x.dim()
        and correction >= 0
    )


def supports_backward(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> bool:
    if not supports(x, dim, correction):
        return False
    upstream = [g for g in (grad_mean, grad_var) if g is not None]
    shape = _split(x.shape, dim)[3]
    return _checks.ready(x, *upstream, device_type="cpu") and all(
        list(g.shape) == shape for g in upstream
    )


_FWD = (*(_lib.ptr,) * 3, *(_lib.i64,) * 4, _lib.i32, _lib.i32)
_BWD = (*(_lib.ptr,) * 4, *(_lib.i64,) * 4, _lib.i32, _lib.i32)


def _cpu(x: torch.Tensor, dim: int, correction: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    outer, n, inner, shape = _split(x.shape, dim)
    mean, var = x.new_empty(shape), x.new_empty(shape)
    if mean.numel() == 0:
        return mean, var
    if n == 0:  # an empty dimension: no data to pass, the result is NaN (like torch)
        return mean.fill_(math.nan), var.fill_(math.nan)
    ptrs = (x.data_ptr(), mean.data_ptr(), var.data_ptr())
    args = (*ptrs, outer, n, inner, correction, _lib.dtype_code(x), _lib.threads())
    _lib.call("spore_mean_var", _FWD, *args)
    return mean, var


def _cpu_backward(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> torch.Tensor:
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx
    outer, n, inner, _ = _split(x.shape, dim)
    ptrs = (_ptr(grad_mean), _ptr(grad_var), x.data_ptr(), dx.data_ptr())
    args = (*ptrs, outer, n, inner, correction, _lib.dtype_code(x), _lib.threads())
    _lib.call("spore_mean_var_backward", _BWD, *args)
    return dx


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fake_backward(
    grad_mean: torch.Tensor | None,
    grad_var: torch.Tensor | None,
    x: torch.Tensor,
    dim: int,
    correction: int,
) -> torch.Tensor:
    _check_upstream(grad_mean, grad_var, x, dim, correction)
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, dim, correction = inputs
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
    ctx.save_for_backward(x)
    ctx.dim, ctx.correction = dim, correction


def _backward(
    ctx: Any, grad_mean: torch.Tensor | None, grad_var: torch.Tensor | None
) -> tuple[Any, ...]:
    (x,) = ctx.saved_tensors
    grads = [None if g is None else g.contiguous() for g in (grad_mean, grad_var)]
    return torch.ops.spore.mean_var_backward(*grads, x, ctx.dim, ctx.correction), None, None


cpu = _checks.direct("mean_var", _cpu, supports)


cpu_backward = _checks.direct("mean_var_backward", _cpu_backward, supports_backward)


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define(
        "mean_var_backward", BACKWARD_SCHEMA, reference=reference_backward, fake=_fake_backward
    )
    registry.kernel(
        bwd, "cpu", _cpu_backward, priority=_checks.PRIORITY, supports=supports_backward
    )
    fwd = registry.define(
        "mean_var", SCHEMA, reference=reference, backward=_backward, setup_context=_setup_context
    )
    registry.kernel(fwd, "cpu", _cpu, priority=_checks.PRIORITY, supports=supports)


def composite(x: torch.Tensor, dim: int = -1, correction: int = 1) -> tuple[torch.Tensor, ...]:
    """What a user writes: two reductions, ``(x.mean(dim), x.var(dim, correction=...))``."""
    return x.mean(dim), x.var(dim, correction=correction)


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    def make(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor]:
        return (torch.randn(8192, 4096, generator=g).to(dtype),)

    return [
        OpBench(
            op="mean_var",
            shape="8192x4096 over the last dim",
            make=make,
            spore=lambda x: torch.ops.spore.mean_var(x, -1),
            baselines={
                "eager": ("eager composite (x.mean(-1), x.var(-1))", composite),
                "var_mean": (
                    "torch.var_mean (outputs swapped)",
                    lambda x: torch.var_mean(x, -1)[::-1],
                ),
            },
        )
    ]
