"""Ascend NPU kernels: spore ops mapped onto torch_npu's fused ops.

``MAPPINGS`` is the table; each entry adapts argument order, keyword names and outputs, and its
``supports`` predicate sends what the fused op does not take to the reference. Ops with no fused
torch_npu op are left out and run their reference on NPU: layer_norm, mean_var, silu_mul, and
the backward ops (torch_npu exposes its fused gradients, e.g. RmsNormGrad and RotaryMulGrad, only
through the autograd of its forward ops). torch_npu is never imported here: :func:`register`
receives the module.

The torch_npu signatures, from Ascend's torch_npu API reference (hiascend.com, "torch_npu"
custom ops list, PyTorch 6.0/7.0 docs) and the op-plugin tests (gitcode.com/Ascend/op-plugin):

- ``npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``; float16/bfloat16/float32; gamma of
  self's dtype, shaped like its last dimensions; rstd is the float reciprocal RMS.
- ``npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x)`` with ``x = x1 + x2`` (the
  op-plugin test unpacks ``y, rstd, x``); x1 and x2 of one shape.
- ``npu_swiglu(input, dim=-1) -> Tensor``: ``swish(A) * B`` with A the first and B the second
  half along dim; contiguous, non-empty input only.
- ``npu_rotary_mul(input, r1, r2, rotary_mode='half') -> Tensor``:
  ``r1 * x + r2 * cat(-x2, x1)`` with ``x1, x2 = chunk(x, 2, -1)``; 4-D input, last dimension
  even and below 896; r1/r2 4-D and broadcast to the input. ``rotary_mode`` (with an
  'interleave' mode) appears from the 7.0 docs on (the 6.0 signature has none), so the call
  leaves it at 'half' and spore's "interleaved" mode, like tables of D/2 columns, runs the
  reference.
- ``npu_gelu(input, approximate='none') -> Tensor``: approximate "none" (erf) or "tanh" (the
  7.2 docs note that torch's own gelu on NPU ignores ``approximate`` and computes tanh).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from spore_kernels import _checks

log = logging.getLogger("spore_kernels.npu")

MAX_DIMS = 8  # torch_npu's fused ops take tensors of at most 8 dimensions
ROTARY_MAX_DIM = 896  # npu_rotary_mul: the last dimension must be below this


@dataclass(frozen=True)
class Mapping:
    """One spore op on one torch_npu fused op.

    ``adapter(torch_npu)`` returns the kernel (spore's signature and outputs); ``supports``
    has spore's signature.
    """

    op: str
    fused: str
    adapter: Callable[[Any], Callable[..., Any]]
    supports: Callable[..., bool]


def _ready(*tensors: torch.Tensor) -> bool:
    """:func:`spore_kernels._checks.ready` tensors that are also non-empty and at most 8-D."""
    return _checks.ready(*tensors) and all(
        t.numel() > 0 and 1 <= t.dim() <= MAX_DIMS for t in tensors
    )


def _rms_norm(npu: Any) -> Callable[..., Any]:
    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, _rstd = npu.npu_rms_norm(x, weight, epsilon=eps)
        return y

    return kernel


def _supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    return _ready(x, weight) and weight.shape == x.shape[-1:] and _checks.valid_eps(eps)


def _add_rms_norm(npu: Any) -> Callable[..., Any]:
    def kernel(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        y, _rstd, total = npu.npu_add_rms_norm(x, residual, weight, eps)
        return y, total

    return kernel


def _supports_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> bool:
    return (
        _ready(x, residual, weight)
        and residual.shape == x.shape
        and weight.shape == x.shape[-1:]
        and _checks.valid_eps(eps)
    )


def _swiglu(npu: Any) -> Callable[..., Any]:
    def kernel(x: torch.Tensor) -> torch.Tensor:
        return npu.npu_swiglu(x, dim=-1)

    return kernel


def _supports_swiglu(x: torch.Tensor) -> bool:
    return _ready(x) and x.shape[-1] % 2 == 0


def _rope(npu: Any) -> Callable[..., Any]:
    def kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
        lead = (1,) * (4 - cos.dim())  # spore's tables broadcast from the right; npu's are 4-D
        return npu.npu_rotary_mul(x, cos.view(*lead, *cos.shape), sin.view(*lead, *sin.shape))

    return kernel


def _supports_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> bool:
    """Mode "half" on 4-D x with tables of D columns (not D/2) broadcasting to it."""
    if mode != "half" or not _ready(x, cos, sin) or x.dim() != 4:
        return False
    dim = x.shape[-1]
    table = (1,) * (4 - cos.dim()) + tuple(cos.shape)
    return (
        cos.shape == sin.shape
        and cos.dim() <= 4
        and cos.shape[-1] == dim
        and dim % 2 == 0
        and dim < ROTARY_MAX_DIM
        and all(c in (1, n) for c, n in zip(table, x.shape, strict=True))
    )


def _gelu(npu: Any) -> Callable[..., Any]:
    def kernel(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return npu.npu_gelu(x, approximate=approximate)

    return kernel


def _supports_gelu(x: torch.Tensor, approximate: str = "none") -> bool:
    return approximate in ("none", "tanh") and _ready(x)


MAPPINGS = [
    Mapping("rms_norm", "npu_rms_norm", _rms_norm, _supports_rms_norm),
    Mapping("add_rms_norm", "npu_add_rms_norm", _add_rms_norm, _supports_add_rms_norm),
    Mapping("swiglu", "npu_swiglu", _swiglu, _supports_swiglu),
    Mapping("rope", "npu_rotary_mul", _rope, _supports_rope),
    Mapping("gelu", "npu_gelu", _gelu, _supports_gelu),
]


@cache
def kernel(mapping: Mapping, torch_npu: Any) -> Callable[..., Any]:
    """``mapping``'s kernel on ``torch_npu``: built once, so registering it again is a no-op."""
    return mapping.adapter(torch_npu)


def register(registry: Any, torch_npu: Any) -> list[str]:
    """Add an ``npu`` kernel for each mapping whose fused op ``torch_npu`` has; the op names."""
    added = []
    for m in MAPPINGS:
        if not hasattr(torch_npu, m.fused):
            log.info("spore-kernels: torch_npu has no %s; %s runs its reference", m.fused, m.op)
            continue
        registry.kernel(
            m.op, "npu", kernel(m, torch_npu), priority=_checks.PRIORITY, supports=m.supports
        )
        added.append(m.op)
    return added
