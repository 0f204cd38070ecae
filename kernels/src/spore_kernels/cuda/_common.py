"""What the Triton launchers share: block sizes, the row launch and the ``supports`` building
block for row norms (on the package's one readiness check, :func:`spore_kernels._checks.ready`).
Nothing here touches a device, so the launchers also run under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors."""

from __future__ import annotations

from typing import Any

import torch
import triton

from spore_kernels._checks import ready, rows_cols

MAX_BLOCK = 4096  # columns one program holds at a time; longer rows loop over chunks
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension


def block(cols: int) -> int:
    """The column block for rows of ``cols``: the next power of two, at most ``MAX_BLOCK``."""
    return min(triton.next_power_of_2(max(cols, 1)), MAX_BLOCK)


def warps(block_size: int) -> int:
    """Warps for a block of ``block_size`` elements (a GPU launch hint; the interpreter ignores
    it)."""
    return 4 if block_size <= 1024 else 8 if block_size <= 4096 else 16


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
