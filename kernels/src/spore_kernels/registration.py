"""Defining spore-kernels' ops and registering their kernels, with or without the plugin manager.

``import spore_kernels`` calls :func:`define`: the ops and kernels go straight to
:mod:`spore.dispatch` under the provider name :data:`PROVIDER`, and no plugin is loaded. When
the plugin manager later loads the ``kernels`` plugin, its ``spore_register_ops`` hook calls
:func:`register` with the ops registry: defining an op again with its schema returns the op
already defined, and registering the same kernel function again under the same provider is a
no-op, so the registry records ops and kernels as the plugin's without redefining them.

Besides the C++ CPU kernels, the ops get Triton kernels on CUDA (when a CUDA device is present
and triton imports) and torch_npu's fused ops on NPU (when torch_npu imports). A missing or
broken triton or torch_npu leaves those ops on their reference for that device, with a log
record saying why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("spore_kernels")

PROVIDER = "kernels"
"""The provider name of every kernel: the plugin's entry-point name, so that the plugin's
registrations match the ones :func:`define` made at import."""


class Registrar(Protocol):
    """What the op families register with: the ops registry or a `spore.dispatch.Registrar`."""

    def define(self, name: str, schema: str, **kwargs: Any) -> Any: ...

    def kernel(
        self,
        op: Any,
        device: str,
        fn: Callable[..., Any],
        *,
        priority: int = 0,
        supports: Callable[..., bool] | None = None,
    ) -> Any: ...


def define() -> None:
    """Define every op with its kernels in :mod:`spore.dispatch` (idempotent)."""
    from spore import dispatch

    register(dispatch.Registrar(PROVIDER))


def register(registry: Registrar) -> None:
    """Define every op family's ops with their CPU kernels, then add the CUDA and NPU kernels."""
    from spore_kernels.ops import FAMILIES

    for family in FAMILIES:
        family.register(registry)
    register_cuda(registry)
    register_npu(registry)


def register_cuda(registry: Registrar) -> bool:
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


def register_npu(registry: Registrar) -> bool:
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
