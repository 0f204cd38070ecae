"""CPU kernels: thin wrappers that hand contiguous tensors to the C++ library."""

from __future__ import annotations

import torch

from spore_kernels._lib import DTYPE_CODES, check, library

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_supports(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """Contiguous CPU x and weight of one kernel dtype, weight matching x's last dimension."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in KERNEL_DTYPES
        and weight.dtype == x.dtype
        and x.dim() >= 1
        and weight.shape == x.shape[-1:]
        and x.shape[-1] > 0
        and x.is_contiguous()
        and weight.is_contiguous()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = torch.empty_like(x)
    if x.numel() == 0:  # an empty batch: nothing to compute (and no buffer to pass)
        return y
    cols = x.shape[-1]
    rows = x.numel() // cols
    status = library().spore_rms_norm(
        x.data_ptr(),
        weight.data_ptr(),
        y.data_ptr(),
        rows,
        cols,
        float(eps),
        DTYPE_CODES[str(x.dtype).removeprefix("torch.")],
        torch.get_num_threads(),
    )
    check(status, "spore_rms_norm")
    return y
