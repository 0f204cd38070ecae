"""``rope(x, cos, sin, mode)``: rotary position embedding, and its backward.

Layout contract: x is ``[..., D]`` with D even — typically ``[B, S, H, D]`` or ``[B, H, S, D]``;
the op rotates pairs within the last dimension and never looks at which leading dimension is
the sequence. ``cos`` and ``sin`` have one shape, ``[..., D]`` or ``[..., D/2]``, whose leading
dimensions broadcast to x's (``[S, 1, D]`` for ``[B, S, H, D]``; ``[B, 1, S, D]`` or ``[S, D]``
for ``[B, H, S, D]``). Modes pair the elements of the last dimension:

- ``"half"`` (rotate-half; Llama, Hugging Face): pairs ``(i, i + D/2)``,
  ``out = x * cos + cat(-x2, x1) * sin`` with ``x1, x2`` the two halves of x;
- ``"interleaved"`` (GPT-J, complex pairs): pairs ``(2i, 2i + 1)``,
  ``out = x * cos + stack(-x_odd, x_even).flatten(-2) * sin``.

A table of D columns is used as given (so Hugging Face's tables, whose halves repeat, are
passed as they are); a table of D/2 columns holds one angle per pair and means the same as its
D-column expansion (halves repeated for "half", each value twice for "interleaved").

Numerics contract: computed in float32 (float64 stays float64) from the given values and
rounded once to x's dtype; the output has x's dtype whatever the tables' dtype, and x's strides
when x is a permutation of a contiguous tensor. The C++ kernel takes CPU x that is contiguous or
such a permutation with its last dimension innermost (e.g. Hugging Face's transposed query),
with contiguous tables of x's dtype or float32 whose broadcast over x's
leading dimensions collapses to at most three groups (every layout above); anything else runs
the reference.

Backward: ``rope_backward(grad, cos, sin, mode) -> dx``, the transpose of the rotation
(``dx = grad * cos - rot(grad * sin)``). cos and sin are treated as constants: their gradient
is None even when they require grad (x's gradient is still exact).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from spore_kernels import _checks, _lib

SCHEMA = "(Tensor x, Tensor cos, Tensor sin, str mode) -> Tensor"
BACKWARD_SCHEMA = "(Tensor grad, Tensor cos, Tensor sin, str mode) -> Tensor"
MODES = ("half", "interleaved")


def check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> None:
    """Clear errors for the inputs rope cannot take."""
    _checks.floating("rope", x=x, cos=cos, sin=sin)
    if mode not in MODES:
        raise ValueError(f"rope: mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if x.dim() < 1 or x.shape[-1] % 2:
        size = x.shape[-1] if x.dim() else "none (a 0-dim tensor)"
        raise ValueError(f"rope rotates pairs: x's last dimension must be even, got {size}")
    if cos.shape != sin.shape:
        raise ValueError(
            f"rope: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    dim = x.shape[-1]
    if cos.dim() < 1 or cos.shape[-1] not in (dim, dim // 2):
        raise ValueError(
            f"rope: cos/sin's last dimension must be {dim} (one value per element of x) or "
            f"{dim // 2} (one per pair), got shape {tuple(cos.shape)}"
        )
    if not _broadcasts(cos.shape[:-1], x.shape[:-1]):
        raise ValueError(
            f"rope: cos/sin of shape {tuple(cos.shape)} do not broadcast to x of shape "
            f"{tuple(x.shape)}: their leading dimensions must be 1 or x's, aligned from the "
            f"right (e.g. [S, 1, D] for x [B, S, H, D], [B, 1, S, D] for x [B, H, S, D])"
        )
    _checks.same_device("rope", x=x, cos=cos, sin=sin)


def _broadcasts(table: torch.Size, batch: torch.Size) -> bool:
    return len(table) <= len(batch) and all(
        t in (1, b) for t, b in zip(reversed(table), reversed(batch), strict=False)
    )


def _full(table: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
    """A table of one value per element of x's last dimension."""
    if table.shape[-1] == dim:
        return table
    if mode == "half":
        return torch.cat([table, table], dim=-1)
    return table.repeat_interleave(2, dim=-1)


def _rotate(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Each pair (u, v) becomes (-v, u)."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)
    return torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)


def _tables(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> tuple[torch.dtype, torch.Tensor, torch.Tensor]:
    compute = _checks.compute_dtype(x)
    dim = x.shape[-1]
    return compute, _full(cos.to(compute), dim, mode), _full(sin.to(compute), dim, mode)


def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    check(x, cos, sin, mode)
    compute, c, s = _tables(x, cos, sin, mode)
    xf = x.to(compute)
    return torch.empty_like(x).copy_(xf * c + _rotate(xf, mode) * s)


def reference_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> torch.Tensor:
    """The transpose of the rotation: dx = grad * cos - rot(grad * sin)."""
    _checks.floating("rope_backward", grad=grad)
    check(grad, cos, sin, mode)
    compute, c, s = _tables(grad, cos, sin, mode)
    gf = grad.to(compute)
    return torch.empty_like(grad).copy_(gf * c - _rotate(gf * s, mode))


def layout(x_shape: torch.Size, table_shape: torch.Size) -> tuple[int, ...] | None:
    """x's rows as (outer, middle, inner) indices and the table row step of each, or None.

    The table is contiguous and broadcast over x's leading dimensions; adjacent dimensions
    that step through the table alike merge, and at most three groups may remain.
    """
    batch = list(x_shape[:-1])
    table = [1] * (len(batch) - len(table_shape) + 1) + list(table_shape[:-1])
    steps, step = [], 1
    for size in reversed(table):
        steps.append(step)
        step *= size
    steps.reverse()
    groups: list[list[int]] = []
    for size, t, st in zip(batch, table, steps, strict=True):
        if size == 1:
            continue
        st = st if t == size else 0
        if groups and groups[-1][1] == st * size:
            groups[-1] = [groups[-1][0] * size, st]
        else:
            groups.append([size, st])
    if len(groups) > 3:
        return None
    groups = [[1, 0]] * (3 - len(groups)) + groups
    return (*(g[0] for g in groups), *(g[1] for g in groups))


def _memory_order(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """The permutation of the dimensions that makes a tensor of this shape and these strides
    contiguous with its last dimension innermost, or None when there is none (overlapping,
    gapped, or the last dimension strided). Hugging Face's ``[B, H, S, D]`` query, a transposed
    ``[B, S, H, D]`` projection, has one."""
    if not shape:
        return None
    order = (*sorted(range(len(shape) - 1), key=lambda d: -strides[d]), len(shape) - 1)
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            return None
        expected *= shape[d]
    return order


@functools.lru_cache(maxsize=512)
def plan(
    shape: torch.Size, strides: tuple[int, ...], table_shape: torch.Size
) -> tuple[int, ...] | None:
    """:func:`layout` of x's rows in x's memory order, for a contiguous table of
    ``table_shape``; None when the kernel cannot index them (x not a permutation of a
    contiguous tensor, or the table's dimensions in another order than x's)."""
    order = _memory_order(shape, strides)
    if order is None:
        return None
    table = (1,) * (len(shape) - len(table_shape)) + tuple(table_shape)
    steps = [d for d in order[:-1] if table[d] != 1]
    if steps != sorted(steps):
        return None
    return layout(torch.Size(shape[d] for d in order), torch.Size(table[d] for d in order))


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> bool:
    """CPU x, contiguous or a permutation of a contiguous tensor with its last dimension
    innermost, and contiguous tables (x's dtype or float32) in a layout the kernel indexes."""
    if mode not in MODES or not x.is_cpu or x.dtype not in _checks.KERNEL_DTYPES or not x.dim():
        return False
    dim = x.shape[-1]
    return (
        dim > 0
        and dim % 2 == 0
        and cos.dtype in (x.dtype, torch.float32)
        and _checks.ready(cos, sin, device_type="cpu")
        and cos.shape == sin.shape
        and cos.dim() >= 1
        and cos.shape[-1] in (dim, dim // 2)
        and _broadcasts(cos.shape[:-1], x.shape[:-1])
        and plan(x.shape, x.stride(), cos.shape) is not None
    )


def supports_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> bool:
    return supports(grad, cos, sin, mode)


_ARGS = (*(_lib.ptr,) * 4, *(_lib.i64,) * 8, *(_lib.i32,) * 6)


def _run(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str, transpose: bool
) -> torch.Tensor:
    """The kernel over x's rows in memory order; the output has x's strides, so its rows lie in
    the same order (a permutation moves no data: the pointers are the tensors')."""
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    lay = plan(x.shape, x.stride(), cos.shape)
    if lay is None:
        raise ValueError("rope: this x/cos/sin layout has no kernel; call the reference")
    rows, dim = _checks.rows_cols(x)
    ptrs = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr())
    flags = (MODES.index(mode), int(cos.shape[-1] != dim), int(transpose))
    codes = (_lib.dtype_code(x), _lib.dtype_code(cos), _lib.threads())
    _lib.call("spore_rope", _ARGS, *ptrs, rows, dim, *lay, *flags, *codes)
    return y


def _cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    return _run(x, cos, sin, mode, transpose=False)


def _cpu_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
) -> torch.Tensor:
    return _run(grad, cos, sin, mode, transpose=True)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, cos, sin, mode = inputs
    ctx.save_for_backward(cos, sin)
    ctx.mode = mode


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    cos, sin = ctx.saved_tensors
    if _memory_order(grad.shape, grad.stride()) is None:
        grad = grad.contiguous()
    return torch.ops.spore.rope_backward(grad, cos, sin, ctx.mode), None, None, None


cpu = _checks.direct("rope", _cpu, supports)


cpu_backward = _checks.direct("rope_backward", _cpu_backward, supports_backward)


def register(registry: Any) -> None:
    """Define the forward and backward ops with their reference and CPU kernels."""
    bwd = registry.define("rope_backward", BACKWARD_SCHEMA, reference=reference_backward)
    registry.kernel(
        bwd, "cpu", _cpu_backward, priority=_checks.PRIORITY, supports=supports_backward
    )
    fwd = registry.define(
        "rope", SCHEMA, reference=reference, backward=_backward, setup_context=_setup_context
    )
    registry.kernel(fwd, "cpu", _cpu, priority=_checks.PRIORITY, supports=supports)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def composite(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's eager RoPE: x * cos + rotate_half(x) * sin, in x's dtype."""
    return x * cos + rotate_half(x) * sin


def composite_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J's eager RoPE on pairs (2i, 2i + 1), tables with each value twice."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


SHAPE = (4, 2048, 32, 128)  # [B, S, H, D]


def _make(mode: str) -> Any:
    def make(dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        _, s, _, d = SHAPE
        x = torch.randn(*SHAPE, generator=g).to(dtype)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq
        full = _full(angles, d, mode)[:, None, :]  # [S, 1, D]
        return x, full.cos().to(dtype), full.sin().to(dtype)

    return make


def benchmarks() -> list[Any]:
    from spore_kernels.benchmarks import OpBench

    shape = "x [4, 2048, 32, 128], cos/sin [2048, 1, 128]"
    return [
        OpBench(
            op="rope",
            shape=shape,
            make=_make("half"),
            spore=lambda x, c, s: torch.ops.spore.rope(x, c, s, "half"),
            baselines={"eager": ("eager x*cos + rotate_half(x)*sin (HF)", composite)},
        ),
        OpBench(
            op="rope_interleaved",
            shape=shape,
            make=_make("interleaved"),
            spore=lambda x, c, s: torch.ops.spore.rope(x, c, s, "interleaved"),
            baselines={"eager": ("eager GPT-J rotate_every_two", composite_interleaved)},
        ),
    ]
