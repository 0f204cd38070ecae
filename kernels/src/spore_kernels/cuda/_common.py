"""What the Triton launchers share: the dtypes they take, the ``supports`` building block and
block sizes. Nothing here touches a device, so the launchers also run under Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors."""

from __future__ import annotations

import torch
import triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_BLOCK = 4096  # columns one program holds at a time; longer rows loop over chunks


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
