"""What the Triton launchers share: the dtypes they take, the ``supports`` building blocks,
block sizes and the row launch. Nothing here touches a device, so the launchers also run under
Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors."""

from __future__ import annotations

from typing import Any

import torch
import triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 4096  # columns one program holds at a time; longer rows loop over chunks
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


def ready(*tensors: torch.Tensor) -> bool:
    """Contiguous tensors of one kernel dtype on one device."""
    first = tensors[0]
    return first.dtype in DTYPES and all(
        t.dtype == first.dtype and t.device == first.device and t.is_contiguous() for t in tensors
    )


def block(cols: int) -> int:
    """The column block for rows of ``cols``: the next power of two, at most ``MAX_BLOCK``."""
    return min(triton.next_power_of_2(max(cols, 1)), MAX_BLOCK)


def warps(block_size: int) -> int:
    """Warps for a block of ``block_size`` elements (a GPU launch hint; the interpreter ignores
    it)."""
    return 4 if block_size <= 1024 else 8 if block_size <= 4096 else 16


def rows_cols(x: torch.Tensor) -> tuple[int, int]:
    """``x`` viewed as [rows, last dimension]."""
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols


def row_launch(kernel: Any, x: torch.Tensor, *args: Any, **named: Any) -> None:
    """Launch a row kernel ``kernel(*args, cols, **named, BLOCK)``, one program per row of
    ``x`` viewed as [rows, cols] (nothing to launch for no rows)."""
    rows, cols = rows_cols(x)
    if rows == 0:
        return
    size = block(cols)
    kernel[(rows,)](*args, cols, **named, BLOCK=size, num_warps=warps(size))


def row_params(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """``ready`` x with a non-empty last dimension, each given parameter of shape
    [x.shape[-1]] and ready with it."""
    given = [p for p in params if p is not None]
    return (
        x.dim() >= 1
        and x.shape[-1] > 0
        and all(p.shape == x.shape[-1:] for p in given)
        and ready(x, *given)
    )
