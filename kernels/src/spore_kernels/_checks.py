"""What the ops and every kernel layer (C++ CPU, Triton CUDA, torch_npu) share: the input errors
references raise, the readiness check a kernel's ``supports`` predicate starts from, the
column sums of the norms' backward references, and the priority every kernel is registered
with."""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

PRIORITY = 10
"""The priority of every spore-kernels kernel (above a provider's default of 0)."""

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def strided(op: str, **tensors: torch.Tensor) -> None:
    """TypeError unless every tensor is dense (strided): the ops' arithmetic does not take a
    sparse or MKL-DNN one (torch failed on it with an internal assert or a missing kernel)."""
    for name, t in tensors.items():
        if t.layout is not torch.strided:
            raise TypeError(
                f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}; "
                f"pass {name}.to_dense()"
            )


def floating(op: str, **tensors: torch.Tensor) -> None:
    """TypeError unless every tensor is a dense (:func:`strided`) tensor of
    float32/bfloat16/float16/float64."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        strided(op, **{name: t})
        if t.dtype not in FLOATS:
            raise TypeError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


FLOAT32_MAX = torch.finfo(torch.float32).max


def valid_eps(eps: float) -> bool:
    """Whether ``eps`` is a number >= 0 finite in float32 (the kernels add it in float32)."""
    return math.isfinite(eps) and 0 <= eps <= FLOAT32_MAX


def epsilon(op: str, eps: float) -> None:
    """ValueError unless ``eps`` is a number >= 0 finite in float32 (a negative or NaN one
    gives NaN rows where it reaches the square root, 1e39 is inf in float32 and zeroes them)."""
    if not valid_eps(eps):
        raise ValueError(
            f"{op}: eps must be a number >= 0 finite in float32 (<= {FLOAT32_MAX:.8g}; e.g. "
            f"1e-6), got {eps}"
        )


def direct(
    op: str, kernel: Callable[..., Any], supports: Callable[..., bool]
) -> Callable[..., Any]:
    """``kernel``, an op's C++ CPU kernel (registered behind ``supports``, which dispatch asks
    first), for calling directly: a ValueError naming ``op`` where ``supports`` refuses the
    arguments (the kernel reads raw pointers: a short weight or another dtype would be read
    past its end or as the wrong type)."""

    @functools.wraps(kernel)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not supports(*args, **kwargs):
            raise ValueError(
                f"{op}: the C++ kernel does not take these arguments (it takes contiguous CPU "
                f"tensors of one dtype, float32, bfloat16 or float16, in the op's shapes, and "
                f"valid settings); torch.ops.spore.{op} takes any the op accepts"
            )
        return kernel(*args, **kwargs)

    return call


def _float32(value: float) -> float:
    """``value`` rounded to float32 (inf where it rounds past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


_LOG2E = _float32(math.log2(math.e))
_OVERFLOW = FLOAT32_MAX + 2.0**103  # float32 rounds a product this large or larger to inf


def valid_kernel_scale(value: float | None) -> bool:
    """Whether the attention kernels take ``value``: they compute in base 2, with
    ``float32(scale) * float32(log2 e)``, which is inf for |scale| beyond about 2.36e38
    (FLT_MAX / log2 e; every output NaN). Beyond it dispatch runs the reference, which takes
    any scale :func:`scale` accepts."""
    # the two float32 factors' product is exact in a double
    return value is None or abs(_float32(value)) * _LOG2E < _OVERFLOW


def kernel_scale(op: str, value: float | None) -> None:
    """ValueError unless an attention kernel called directly takes ``value``
    (:func:`valid_kernel_scale`)."""
    if not valid_kernel_scale(value):
        raise ValueError(
            f"{op}: the kernel takes |scale| <= {FLOAT32_MAX / math.log2(math.e):.4g} (it "
            f"computes in base 2, scale * log2 e in float32), got {value}; "
            f"torch.ops.spore.{op} takes it (it runs the reference)"
        )


def scale(op: str, value: float | None) -> None:
    """ValueError unless ``value`` is None or a number finite in float32 (the kernels compute in
    it): a NaN or infinite one, or 1e39 (finite as a Python float), gives NaN outputs."""
    if value is not None and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ValueError(
            f"{op}: scale must be finite in float32 (|scale| <= {FLOAT32_MAX:.8g}) or None "
            f"(1/sqrt(D)), got {value}"
        )


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


def upstream(op: str, shape: Sequence[int], **grads: torch.Tensor | None) -> None:
    """TypeError unless each given gradient is floating-point (:func:`floating`), ValueError
    unless it has ``shape``, the forward output's (a wrong one would broadcast into a wrong
    result, or fail deep inside the reference)."""
    floating(op, **{name: g for name, g in grads.items() if g is not None})
    for name, g in grads.items():
        if g is not None and g.shape != tuple(shape):
            raise ValueError(
                f"{op}: {name} must have the forward output's shape {tuple(shape)}, "
                f"got {tuple(g.shape)}"
            )


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype references compute in: float64 for float64, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
"""The tensor types a kernel takes: a subclass's own methods (``is_contiguous``, ``stride``,
``data_ptr``) could misstate the memory a kernel reads, so its calls run the reference."""


def ready(*tensors: torch.Tensor, device_type: str | None = None) -> bool:
    """Contiguous dense plain tensors (:data:`PLAIN_TENSORS`, strided layout: an MKL-DNN one
    says it is contiguous) of one kernel dtype (float32, bfloat16, float16) on one device, of
    type ``device_type`` when given."""
    first = tensors[0]
    dtype = first.dtype
    if dtype not in KERNEL_DTYPES or any(
        type(t) not in PLAIN_TENSORS or t.layout is not torch.strided for t in tensors
    ):
        return False
    if device_type == "cpu" or (device_type is None and first.is_cpu):
        # the common case, without building device objects (a few µs each)
        return all(t.is_cpu and t.dtype == dtype and t.is_contiguous() for t in tensors)
    device = first.device
    return (device_type is None or device.type == device_type) and all(
        t.dtype == dtype and t.device == device and t.is_contiguous() for t in tensors
    )


def column_sums(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every dimension but the last (also when that one is empty)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).sum(0)


def centred(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` less its mean along ``dim``, centred twice: less the mean, then less the mean of
    that. The first mean's rounding (up to half an ulp of the mean) would otherwise reach every
    value: a constant row of 88.7 became ±8e-6, which layer_norm scaled to ±2.4e-3. A row whose
    first centring holds an inf or NaN is centred once (as torch's own ops: the second mean,
    NaN, made the row's other values NaN where they are ±inf)."""
    first = x - x.mean(dim, keepdim=True)
    second = first.mean(dim, keepdim=True)
    return first - torch.where(second.isfinite(), second, 0.0)


def rows_cols(x: torch.Tensor) -> tuple[int, int]:
    """``x`` viewed as [rows, last dimension]."""
    cols = x.shape[-1]
    return (x.numel() // cols if cols else 0), cols
