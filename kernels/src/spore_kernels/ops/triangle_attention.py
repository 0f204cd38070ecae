"""``triangle_attention(q, k, v, bias=None, mask=None, scale=None)`` and its backward.

Layout contract: q is ``[*, I, J, H, D]`` and k, v are ``[*, I, K, H, D]`` (linear projections
viewed as heads, not transposed; any number of leading batch dims, none included), all of one
float dtype. ``bias`` (q's dtype) is ``[*, H, J, K]``, shared by every row i (the triangle or
pair bias); ``mask`` is bool ``[*, I, K]``, True = attend. The output is ``[*, I, J, H, D]`` in
q's dtype::

    s[*, i, h, j, k] = scale * q[*, i, j, h] . k[*, i, k, h] + bias[*, h, j, k]
    out[*, i, j, h] = softmax_k(s[*, i, h, j]) @ v[*, i, :, h]

over the keys the mask keeps; ``scale`` defaults to ``1/sqrt(D)``. A row whose keys are all
masked (or with no keys) gets zeros and zero gradients.

Numerics contract: computed in float32 whatever the input dtype (float64 stays float64, on the
reference) and rounded once to q's dtype.

Backward: ``triangle_attention_backward(grad, q, k, v, bias, mask, out, scale) -> (dq, dk, dv,
dbias)``, each in its input's dtype; ``dbias`` sums over I, and is an empty tensor when bias is
None. Forward saves its inputs and ``out`` (never the probabilities).

Kernels: C++ on CPU (``csrc/triangle_attention.cpp``) and Triton on CUDA
(``spore_kernels.cuda.triangle_attention``), forward and backward, for float32, bfloat16 and
float16 tensors of one device with elements (any strides: made contiguous); anything else
(float64, empty inputs) runs the reference, :func:`composite`, which builds the logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from spore_kernels import _checks, _lib

OP = "triangle_attention"
SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? bias=None, Tensor? mask=None, float? scale=None) "
    "-> Tensor"
)
BACKWARD_SCHEMA = (
    "(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? mask, Tensor out, "
    "float? scale) -> (Tensor, Tensor, Tensor, Tensor)"
)


def check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> None:
    """Clear errors for inputs triangle_attention cannot take (dtypes, shapes, devices, scale)."""
    tensors = {"q": q, "k": k, "v": v} | ({} if bias is None else {"bias": bias})
    _checks.floating(OP, **tensors)
    if len({t.dtype for t in tensors.values()}) != 1:
        found = ", ".join(f"{n} {t.dtype}" for n, t in tensors.items())
        raise TypeError(f"{OP}: q, k, v and bias must have one dtype, got {found}; convert them")
    if q.dim() < 4:
        raise ValueError(f"{OP}: q must be [*, I, J, H, D] (4-D or more), got {tuple(q.shape)}")
    *batch, i, j, h, d = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"{OP}: k and v must have one shape [*, I, K, H, D], got {tuple(k.shape)} and "
            f"{tuple(v.shape)}"
        )
    if k.dim() != q.dim() or k.shape[:-4] != q.shape[:-4] or k.shape[-4] != i:
        raise ValueError(
            f"{OP}: k and v must be [*, I, K, H, D] with q's batch dims and I "
            f"({(*batch, i)}), got k {tuple(k.shape)} for q {tuple(q.shape)}"
        )
    if k.shape[-2] != h:
        raise ValueError(
            f"{OP}: k and v must have q's head count H = {h}, got {k.shape[-2]} "
            f"(k {tuple(k.shape)}, q {tuple(q.shape)}); expand or split heads to match"
        )
    if k.shape[-1] != d:
        raise ValueError(
            f"{OP}: k and v must have q's head dim D = {d}, got {k.shape[-1]} "
            f"(k {tuple(k.shape)}, q {tuple(q.shape)})"
        )
    keys = k.shape[-3]
    if bias is not None and tuple(bias.shape) != (*batch, h, j, keys):
        raise ValueError(
            f"{OP}: bias must be [*, H, J, K] = {(*batch, h, j, keys)} (shared over I), got "
            f"{tuple(bias.shape)}"
        )
    if mask is not None:
        _checks.strided(OP, mask=mask)
        if mask.dtype != torch.bool:
            raise TypeError(
                f"{OP}: mask must be a bool tensor (True = attend), got {mask.dtype}; pass "
                f"mask.bool() (or mask > 0.5 for a float 0/1 mask)"
            )
        if tuple(mask.shape) != (*batch, i, keys):
            raise ValueError(
                f"{OP}: mask must be [*, I, K] = {(*batch, i, keys)}, got {tuple(mask.shape)}"
            )
    _checks.scale(OP, scale)
    named = tensors | ({} if mask is None else {"mask": mask})
    _checks.same_device(OP, **named)


def default_scale(q: torch.Tensor, scale: float | None) -> float:
    """``scale``, or ``1/sqrt(D)`` when None (1 for D = 0, whose output is empty)."""
    if scale is not None:
        return float(scale)
    return 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0


def probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The ``[*, I, H, J, K]`` attention probabilities (no checks) in the compute dtype: einsum,
    + bias, mask, softmax; rows with no key left are zeros."""
    compute = _checks.compute_dtype(q)
    s = torch.einsum("...ijhd,...ikhd->...ihjk", q.to(compute), k.to(compute))
    s = s * default_scale(q, scale)
    if bias is not None:
        s = s + bias.to(compute).unsqueeze(-4)
    if mask is None:
        return torch.softmax(s, dim=-1)
    keep = mask[..., None, None, :]  # [*, I, 1, 1, K]
    # A row with no key left attends uniformly (finite gradients), then is zeroed.
    s = s.masked_fill(~keep, float("-inf")).masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return torch.softmax(s, dim=-1) * mask.any(-1)[..., None, None, None].to(compute)


def composite(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The unfused composite (no checks): einsum, + bias, mask, softmax, einsum, in float32
    (float64 stays float64). Materialises the ``[*, I, H, J, K]`` logits."""
    p = probabilities(q, k, bias, mask, scale)
    return torch.einsum("...ihjk,...ikhd->...ijhd", p, _kept(v, mask, p.dtype)).to(q.dtype)


def _kept(x: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ``x`` in ``dtype``, 0 at a masked key: its probability (and dS) is 0, and
    0 * NaN or inf in padding would reach the row (or dq)."""
    x = x.to(dtype)
    return x if mask is None else x.masked_fill(~mask[..., None, None], 0.0)


def additive_mask_composite(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The composite as models write it (Protenix, OpenFold): the mask added as a -1e9 bias
    and one softmax, in float32 (a row with no key attends uniformly instead of giving zeros).
    A speed baseline, not an oracle."""
    qf, kf, vf = (t.float() for t in (q, k, v))
    s = torch.einsum("...ijhd,...ikhd->...ihjk", qf, kf) * default_scale(q, scale)
    if bias is not None:
        s = s + bias.float().unsqueeze(-4)
    if mask is not None:
        s = s + ((mask.float() - 1.0) * 1e9)[..., None, None, :]
    p = torch.softmax(s, dim=-1)
    return torch.einsum("...ihjk,...ikhd->...ijhd", p, vf).to(q.dtype)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`composite` after :func:`check`, contiguous: the oracle."""
    check(q, k, v, bias, mask, scale)
    return composite(q, k, v, bias, mask, scale).contiguous()


def reference_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The closed form in the compute dtype (``P`` the probabilities, ``dO`` = grad): dv =
    P^T dO, dP = dO v^T, dS = P * (dP - rowsum(P * dP)), dq = scale dS k, dk = scale dS^T q,
    dbias = dS summed over I; each rounded once."""
    check_backward(grad, q, k, v, bias, mask, out, scale)
    p = probabilities(q, k, bias, mask, scale)
    qf, g = (t.to(p.dtype) for t in (q, grad))
    kf, vf = (_kept(t, mask, p.dtype) for t in (k, v))
    dv = torch.einsum("...ihjk,...ijhd->...ikhd", p, g)
    dp = torch.einsum("...ijhd,...ikhd->...ihjk", g, vf)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    c = default_scale(q, scale)
    dq = torch.einsum("...ihjk,...ikhd->...ijhd", ds, kf) * c
    dk = torch.einsum("...ihjk,...ijhd->...ikhd", ds, qf) * c
    dbias = ds.sum(-4).to(bias.dtype) if bias is not None else q.new_empty(0)
    grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


def check_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> None:
    """The forward's checks, and grad and out shaped like q."""
    check(q, k, v, bias, mask, scale)
    for name, t in (("grad", grad), ("out", out)):
        _checks.floating(OP + "_backward", **{name: t})
        if t.shape != q.shape:
            raise ValueError(
                f"{OP}_backward: {name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}"
            )
    _checks.same_device(OP + "_backward", q=q, grad=grad, out=out)


def _fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    check(q, k, v, bias, mask, scale)
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _fake_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    check_backward(grad, q, k, v, bias, mask, out, scale)
    dbias = q.new_empty(0) if bias is None else torch.empty_like(bias)
    return (
        *(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
        dbias.contiguous(),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, bias, mask, scale = inputs
    ctx.save_for_backward(q, k, v, bias, mask, output)
    ctx.scale = scale


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    q, k, v, bias, mask, out = ctx.saved_tensors
    dq, dk, dv, dbias = torch.ops.spore.triangle_attention_backward(
        grad.contiguous(), q, k, v, bias, mask, out, ctx.scale
    )
    return dq, dk, dv, (dbias if bias is not None else None), None, None


def _kernel_ready(
    tensors: tuple[torch.Tensor | None, ...], mask: torch.Tensor | None, device_type: str
) -> bool:
    """Tensors of one kernel dtype (float32, bfloat16, float16) on ``device_type``, with
    elements; any strides (the wrappers make them contiguous)."""
    present = [t for t in tensors if t is not None]
    first = present[0]
    if first.dtype not in _checks.KERNEL_DTYPES or first.device.type != device_type:
        return False
    if any(t.dtype != first.dtype or t.device != first.device for t in present):
        return False
    if mask is not None and mask.device != first.device:
        return False
    return all(t.numel() > 0 for t in tensors[:3])


def supports(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> bool:
    """CPU q, k, v (and bias) of one kernel dtype with elements, valid shapes, a scale the
    kernel takes (:func:`spore_kernels._checks.valid_kernel_scale`); any strides."""
    if not (_kernel_ready((q, k, v, bias), mask, "cpu") and _checks.valid_kernel_scale(scale)):
        return False
    try:
        check(q, k, v, bias, mask, scale)
    except (TypeError, ValueError):
        return False
    return True


def supports_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> bool:
    """:func:`supports`, with grad and out of q's dtype and shape."""
    if not (
        _kernel_ready((q, k, v, bias, grad, out), mask, "cpu") and _checks.valid_kernel_scale(scale)
    ):
        return False
    try:
        check_backward(grad, q, k, v, bias, mask, out, scale)
    except (TypeError, ValueError):
        return False
    return True


def _sizes(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    """(batch, I, J, K, H, D) with the leading dims flattened into one batch."""
    *batch, i, j, h, d = q.shape
    return (math.prod(batch), i, j, k.shape[-3], h, d)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


_FWD = (*(_lib.ptr,) * 6, *(_lib.i64,) * 6, _lib.f32, _lib.i32, _lib.i32)
_BWD = (*(_lib.ptr,) * 10, *(_lib.i64,) * 6, _lib.f32, _lib.i32, _lib.i32)


def cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The C++ forward, after the reference's checks (inputs made contiguous)."""
    check(q, k, v, bias, mask, scale)
    _checks.kernel_scale(OP, scale)
    if not supports(q, k, v, bias, mask, scale):
        raise ValueError(
            f"{OP}: the CPU kernel takes float32/bfloat16/float16 CPU tensors with elements, "
            f"got {q.dtype} on {q.device}; call torch.ops.spore.{OP}, which picks a kernel or "
            f"the reference"
        )
    q, k, v = (t.contiguous() for t in (q, k, v))
    bias = None if bias is None else bias.contiguous()
    mask = None if mask is None else mask.contiguous()
    out = torch.empty_like(q)
    args = (*map(_ptr, (q, k, v, bias, mask, out)), *_sizes(q, k), default_scale(q, scale))
    _lib.call("spore_triangle_attention", _FWD, *args, _lib.dtype_code(q), _lib.threads())
    return out


def cpu_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    mask: torch.Tensor | None,
    out: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C++ backward, after the reference's checks (inputs made contiguous)."""
    check_backward(grad, q, k, v, bias, mask, out, scale)
    _checks.kernel_scale(f"{OP}_backward", scale)
    if not supports_backward(grad, q, k, v, bias, mask, out, scale):
        raise ValueError(
            f"{OP}_backward: the CPU kernel takes float32/bfloat16/float16 CPU tensors with "
            f"elements, got {q.dtype} on {q.device}; call torch.ops.spore.{OP}_backward"
        )
    grad, q, k, v = (t.contiguous() for t in (grad, q, k, v))
    bias = None if bias is None else bias.contiguous()
    mask = None if mask is None else mask.contiguous()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    dbias = q.new_empty(0) if bias is None else torch.empty_like(bias)
    ptrs = (grad, q, k, v, bias, mask, dq, dk, dv, None if bias is None else dbias)
    args = (*map(_ptr, ptrs), *_sizes(q, k), default_scale(q, scale))
    _lib.call("spore_triangle_attention_backward", _BWD, *args, _lib.dtype_code(q), _lib.threads())
    return dq, dk, dv, dbias


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define(
        OP + "_backward", BACKWARD_SCHEMA, reference=reference_backward, fake=_fake_backward
    )
    registry.kernel(bwd, "cpu", cpu_backward, priority=_checks.PRIORITY, supports=supports_backward)
    fwd = registry.define(
        OP,
        SCHEMA,
        reference=reference,
        fake=_fake,
        backward=_backward,
        setup_context=_setup_context,
    )
    registry.kernel(fwd, "cpu", cpu, priority=_checks.PRIORITY, supports=supports)


BENCH_TOKENS, BENCH_HEADS, BENCH_DIM = 128, 4, 32


def bench_inputs(
    dtype: torch.dtype,
    g: torch.Generator,
    n: int = BENCH_TOKENS,
    heads: int = BENCH_HEADS,
    dim: int = BENCH_DIM,
) -> tuple[torch.Tensor, ...]:
    """A Pairformer triangle attention's inputs: q, k, v ``[1, n, n, heads, dim]``, bias
    ``[1, heads, n, n]`` and a bool mask ``[1, n, n]`` dropping 10 % of the keys."""
    q, k, v = (torch.randn(1, n, n, heads, dim, generator=g).to(dtype) for _ in range(3))
    bias = torch.randn(1, heads, n, n, generator=g).to(dtype)
    return q, k, v, bias, torch.rand(1, n, n, generator=g) >= 0.1


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    n, h, d = BENCH_TOKENS, BENCH_HEADS, BENCH_DIM
    return [
        OpBench(
            op=OP,
            shape=f"q [1, {n}, {n}, {h}, {d}] with bias and mask",
            make=bench_inputs,
            spore=lambda *a: torch.ops.spore.triangle_attention(*a),
            baselines={
                "eager": ("composite, mask as an additive bias", additive_mask_composite),
                "reference": ("the op's reference composite", composite),
            },
            differentiable=(0, 1, 2, 3),
        )
    ]
