"""Reference implementations in plain torch: the oracle every kernel is compared with.

Numerics contract (rms_norm): computed in float32 whatever the input dtype — normalise, then
multiply by the weight in float32 — and rounded once to the input dtype (the Gemma-style cast
order; Llama's HF code rounds before multiplying by the weight, which differs by up to one
rounding step in bf16/fp16).
"""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Clear errors for the inputs rms_norm cannot take."""
    if x.dtype not in FLOATS:
        raise TypeError(f"rms_norm needs a floating-point x, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("rms_norm needs x with at least one dimension")
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm weight must have shape {tuple(x.shape[-1:])} (x's last dimension), "
            f"got {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm(x, weight)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(compute)
    return out.to(x.dtype)
