"""Input checks shared by the ops: clear errors for what an op cannot take, and the predicates
that decide whether a C++ CPU kernel takes a call (anything else runs the reference)."""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def floating(op: str, **tensors: torch.Tensor) -> None:
    """TypeError unless every tensor is float32/bfloat16/float16/float64."""
    for name, t in tensors.items():
        if t.dtype not in FLOATS:
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


def same_device(op: str, **tensors: torch.Tensor) -> None:
    """ValueError naming the two devices when the tensors are not on one device."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{op}: {first_name} is on {first.device} but {name} is on {t.device}; "
                f"move them to one device"
            )


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: float64 for float64, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def kernel_ready(*tensors: torch.Tensor) -> bool:
    """CPU, contiguous, and all of one kernel dtype."""
    dtype = tensors[0].dtype
    return dtype in KERNEL_DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors
    )


def rows_cols(x: torch.Tensor) -> tuple[int, int]:
    """``x`` viewed as [rows, last dimension]."""
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols
