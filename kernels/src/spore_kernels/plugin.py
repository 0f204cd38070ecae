"""spore-kernels' Spore hooks: the ops with their kernels, and the benchmarks.

Besides the C++ CPU kernels, the ops get Triton kernels on CUDA (when triton imports and a CUDA
device is present) and torch_npu's fused ops on NPU (when torch_npu imports). Both are looked
up when the ops are registered, never at import; a missing or broken triton or torch_npu leaves
those ops on their reference for that device, with a log record saying why.
"""

from __future__ import annotations

import logging

import spore
from spore.registry import OpRegistry, Registry

log = logging.getLogger("spore_kernels")


@spore.hookimpl
def spore_register_ops(registry: OpRegistry) -> None:
    from spore_kernels.ops import FAMILIES

    for family in FAMILIES:
        family.register(registry)
    register_cuda(registry)
    register_npu(registry)


def register_cuda(registry: OpRegistry) -> bool:
    """Add the Triton kernels when CUDA is available and triton imports; never raises."""
    import torch

    if not torch.cuda.is_available():  # checked first: without CUDA, triton is never imported
        log.debug("spore-kernels: no CUDA kernels: no CUDA device")
        return False
    try:
        import triton  # noqa: F401
    except Exception as exc:  # not installed, or an install that fails on import
        log.debug("spore-kernels: no CUDA kernels: triton does not import (%s)", exc)
        return False
    try:
        from spore_kernels import cuda

        cuda.register(registry)
    except Exception as exc:
        log.warning("spore-kernels: CUDA kernels not registered: %s: %s", type(exc).__name__, exc)
        return False
    return True


def register_npu(registry: OpRegistry) -> bool:
    """Add the torch_npu fused-op kernels when torch_npu imports; never raises."""
    try:
        import torch_npu
    except Exception as exc:  # not installed, or an install that fails on import
        log.debug("spore-kernels: no NPU kernels: torch_npu does not import (%s)", exc)
        return False
    try:
        from spore_kernels import npu

        npu.register(registry, torch_npu)
    except Exception as exc:
        log.warning("spore-kernels: NPU kernels not registered: %s: %s", type(exc).__name__, exc)
        return False
    return True


@spore.hookimpl
def spore_register_benchmarks(registry: Registry) -> None:
    from spore_kernels.benchmarks import benchmarks

    for case in benchmarks():
        registry.add(case)
