"""Attention backend selection: one op, ``torch.ops.spore.lite_boost_attention``, with a kernel
per backend and device, chosen per call by :mod:`spore.dispatch`.

Order (highest priority first): FlashAttention-3 and FlashAttention-2 on CUDA, torch_npu's
fused inference attention on Ascend, then PyTorch's ``scaled_dot_product_attention`` on every
device (also the reference). A backend is registered only when its package imports; one that
is installed but fails to import is skipped with a logged reason. FlashAttention and torch_npu
are chosen only for q, k, v that pass :func:`check_qkv` (else SDPA raises its error, on every
device) with a unit stride along head_dim and v of q's head_dim (else SDPA runs).
``LITE_BOOST_ATTENTION=sdpa`` (or :func:`use_backend`) forces one backend;
``spore.dispatch.explain`` says which runs and why.

Layout: ``q``, ``k``, ``v`` are ``(batch, heads, seq, head_dim)``, as for SDPA; ``k``/``v`` may
have fewer heads than ``q`` when ``q``'s head count is a multiple of theirs (grouped queries).
Under autocast the op casts float32, float16 and bfloat16 ``q``, ``k``, ``v`` (mixed or not) to
autocast's dtype first, as autocast casts SDPA's (the op's ``autocast`` function): eager, traced
and compiled calls take the same dtypes, and ``explain`` judges the cast tensors.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spore import dispatch

log = logging.getLogger("lite_boost")

OP = "lite_boost_attention"
SCHEMA = "(Tensor q, Tensor k, Tensor v, float? scale=None) -> Tensor"
PROVIDER = "lite-boost"
ENV = "LITE_BOOST_ATTENTION"


@dataclass(frozen=True)
class Backend:
    """One attention backend: its device, the module it needs, its priority."""

    name: str
    device: str
    module: str | None
    priority: int
    dtypes: tuple[torch.dtype, ...]
    max_head_dim: int


BACKENDS = (
    Backend(
        "flash_attn_3", "cuda", "flash_attn_interface", 30, (torch.float16, torch.bfloat16), 256
    ),
    Backend("flash_attn_2", "cuda", "flash_attn", 20, (torch.float16, torch.bfloat16), 256),
    Backend("torch_npu", "npu", "torch_npu", 20, (torch.float16, torch.bfloat16), 512),
    *(
        Backend("sdpa", device, None, 1, (torch.float32, torch.float16, torch.bfloat16), 1 << 30)
        for device in ("cpu", "cuda", "npu")
    ),
)
NAMES = tuple(dict.fromkeys(b.name for b in BACKENDS))

_local = threading.local()
_UNSET = object()  # no use_backend block on this thread: the environment decides


def forced() -> str | None:
    """The backend :func:`use_backend` forces (``None`` in a ``use_backend(None)`` block), else
    the one ``LITE_BOOST_ATTENTION`` forces, else ``None``."""
    name = getattr(_local, "forced", _UNSET)
    if name is _UNSET:
        name = os.environ.get(ENV) or None
    if name is not None and name not in NAMES:
        raise ValueError(f"{ENV}={name!r} is not an attention backend; choose one of {NAMES}")
    return name


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force attention backend ``name`` (``None``: automatic) inside the ``with`` block, on this
    thread; a forced backend that cannot take a call falls back to SDPA."""
    if name is not None and name not in NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {NAMES}")
    previous = getattr(_local, "forced", _UNSET)
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = previous


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """PyTorch's SDPA (grouped heads expanded), the oracle and the portable backend."""
    forced()  # a misspelt LITE_BOOST_ATTENTION is an error (dispatch ignores supports' errors)
    check_qkv(q, k, v)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


_AUTOCAST_CASTS = frozenset({torch.float32, torch.float16, torch.bfloat16})


def autocast_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k`` and ``v`` in autocast's dtype where autocast is on for their device and
    casts each of them (it leaves float64), as it casts SDPA's; else as they are."""
    device = q.device.type
    if not (
        {q.dtype, k.dtype, v.dtype} <= _AUTOCAST_CASTS
        and torch.amp.is_autocast_available(device)
        and torch.is_autocast_enabled(device)
    ):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _autocast_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[Any, ...]:
    """The op's arguments as its kernels take them under autocast (:func:`autocast_qkv`)."""
    return (*autocast_qkv(q, k, v), scale)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """(batch, heads, seq, head_dim) floating-point tensors of one dtype; k and v alike but
    for v's head_dim, which may differ (as SDPA takes it); q's heads a multiple of k's."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    if not all(d.is_floating_point for d in dtypes) or len(set(dtypes)) > 1:
        raise TypeError(
            f"lite_boost attention takes floating-point q, k and v of one dtype, got "
            f"{', '.join(map(str, dtypes))}; convert them to one (e.g. q.float())"
        )
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "lite_boost attention takes (batch, heads, seq, head_dim) tensors, got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match each other in batch, heads "
            f"and seq, and k must match q {tuple(q.shape)} in batch and head_dim"
        )
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"q ({q.shape[1]}) and k/v ({k.shape[1]}) need at least one head each")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q's {q.shape[1]} heads must be a multiple of k/v's {k.shape[1]}")


def _flash(module: Any, version: int) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        # flash-attn takes (batch, seq, heads, head_dim) and handles grouped heads itself
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = module.flash_attn_func(*args, softmax_scale=scale)
        out = out[0] if version == 3 and isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return run


def _npu(module: Any) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out, _ = module.npu_fused_infer_attention_score(
            q, k, v, num_heads=q.shape[1], num_key_value_heads=k.shape[1],
            input_layout="BNSD", scale=scale,
        )  # fmt: skip
        return out

    return run


def _unit_head_stride(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``q``, ``k`` and ``v`` each have stride 1 along head_dim, the one layout the
    FlashAttention and torch_npu kernels are given (SDPA takes any)."""
    return q.stride(-1) == k.stride(-1) == v.stride(-1) == 1


@functools.cache  # one function per backend: registering it again is then a no-op
def _supports(backend: Backend) -> Callable[..., bool]:
    def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None):
        choice = forced()
        if choice is not None and choice != backend.name:
            return False  # forced or not, a backend takes only calls it can run
        if backend.module is not None:
            # before the device check (testable on CPU): when this raises, dispatch passes the
            # call on to SDPA, which raises the same error on every device
            check_qkv(q, k, v)
            if not _unit_head_stride(q, k, v) or v.shape[-1] != q.shape[-1]:
                return False  # the device kernels take one layout and one head_dim
        return (
            q.device.type == backend.device
            and q.dtype in backend.dtypes
            and k.dtype == q.dtype == v.dtype
            and q.shape[-1] <= backend.max_head_dim
            and (backend.module is None or q.shape[-1] % 8 == 0)
        )

    return supports


@functools.cache
def _implementation(backend: Backend) -> Callable[..., torch.Tensor] | None:
    """The backend's kernel, ``None`` when its package is absent or broken (logged)."""
    if backend.module is None:
        return reference
    try:
        module = importlib.import_module(backend.module)
    except Exception as exc:
        absent = isinstance(exc, ModuleNotFoundError) and (
            exc.name is not None and f"{backend.module}.".startswith(f"{exc.name}.")
        )  # the package itself; a module it imports missing (its compiled part) is broken
        if not absent:  # installed but broken: say so, keep the others
            log.warning(
                "lite-boost: attention backend %s skipped: importing %s raised %s: %s",
                backend.name, backend.module, type(exc).__name__, exc,
            )  # fmt: skip
        return None
    if backend.name == "torch_npu":
        return _npu(module)
    return _flash(module, 3 if backend.name == "flash_attn_3" else 2)


def register(registry: Any) -> Any:
    """Define the op and register each available backend with ``registry`` (the ops registry
    or :mod:`spore.dispatch` itself); returns the op."""
    op = registry.define(OP, SCHEMA, reference=reference, autocast=_autocast_args)
    for backend in BACKENDS:
        fn = _implementation(backend)
        if fn is not None:
            registry.kernel(
                op,
                backend.device,
                fn,
                priority=backend.priority,
                supports=_supports(backend),
                provider=f"{PROVIDER}:{backend.name}",
            )
    return op


_op = register(dispatch.Registrar(PROVIDER)).packet  # torch.ops.spore.<OP>


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Attention of ``(batch, heads, seq, head_dim)`` tensors on the best available backend."""
    return _op(q, k, v, scale)
