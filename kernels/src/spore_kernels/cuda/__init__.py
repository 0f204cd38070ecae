"""Triton kernels for CUDA devices, one module per op family, each with a ``KERNELS`` table
``{op name: (launcher, supports)}``. Importing this package imports triton; the plugin does it
only when a CUDA device is present and triton imports. The launchers take tensors on any device,
so under Triton's interpreter (``TRITON_INTERPRET=1``) they run on CPU tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spore_kernels._checks import PRIORITY
from spore_kernels.cuda import (
    add_rms_norm,
    block_sparse_attention,
    gelu,
    glu,
    layer_norm,
    mean_var,
    rms_norm,
    rope,
    triangle_attention,
)

FAMILIES = [
    rms_norm,
    add_rms_norm,
    layer_norm,
    mean_var,
    gelu,
    glu,
    rope,
    block_sparse_attention,
    triangle_attention,
]


def kernels() -> dict[str, tuple[Callable[..., Any], Callable[..., bool]]]:
    """Every Triton kernel by op name: its launcher and ``supports`` predicate."""
    table: dict[str, tuple[Callable[..., Any], Callable[..., bool]]] = {}
    for family in FAMILIES:
        table.update(family.KERNELS)
    return table


def register(registry: Any) -> None:
    """Add each launcher as the op's ``cuda`` kernel (the ops must already be defined)."""
    for name, (launcher, supports) in kernels().items():
        registry.kernel(name, "cuda", launcher, priority=PRIORITY, supports=supports)
