"""Chunked execution along an axis a module does not reduce over, and memory plans on modules.

:func:`chunked` is the one chunking helper every module uses: it calls ``fn`` on consecutive
slices of an output axis and writes each piece into one output tensor (allocated once, or the
caller's ``out``, optionally accumulating into it for in-place residual updates in inference).
Each piece is exact: a module chunks only an axis whose entries are computed independently, so
chunked and whole results agree to rounding.

:func:`apply_plan` hands a :class:`~sci_protenix.memory_plan.MemoryPlan` to every sci-protenix
module inside a model; each module then takes its chunk size from the plan field of its kind.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sci_protenix.memory_plan import MemoryPlan

Kind = Literal["tri_mul", "tri_att", "transition", "pair_bias", "outer_product", "msa"]
M = TypeVar("M", bound=nn.Module)


def check_chunk_size(chunk_size: int | None, name: str = "chunk_size") -> int | None:
    """``chunk_size`` as an int when None or a positive integer (a Python or numpy one, or a
    0-d integer tensor); a ValueError naming the fix and the setting (``name``) otherwise (a
    bool or bool tensor, a float, a string, a tensor with dims)."""
    if chunk_size is None:
        return None
    size = _index(chunk_size)
    if size is None or size <= 0:
        raise ValueError(
            f"{name} must be a positive int (rows per chunk) or None (no chunking), "
            f"got {chunk_size!r}"
        )
    return size


def _index(value: object) -> int | None:
    """``value`` as an int when ``operator.index`` takes it, else ``None``: also for a bool, a
    bool tensor (whose index is 0 or 1) and a tensor of one or more dims (one element is
    indexable)."""
    if isinstance(value, bool) or (
        isinstance(value, torch.Tensor) and (value.dim() or value.dtype == torch.bool)
    ):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def chunked(
    fn: Callable[..., torch.Tensor],
    length: int,
    size: int | None,
    dim: int,
    args: tuple[Any, ...] = (),
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    recompute: bool = False,
    split: int | None = None,
) -> torch.Tensor:
    """``fn(sl, *args)`` over ``slice``s of ``size`` entries of an axis of ``length``, joined
    along ``dim``.

    ``fn`` returns the output for positions ``sl`` of that axis (at ``dim`` of its result).
    With ``out`` the pieces are written into it (``out[..., sl, ...] = piece``, or ``+=`` when
    ``accumulate``) and ``out`` is returned. Without, pieces that need a gradient are
    concatenated (whose backward only slices the gradient), others are written into one tensor
    the first piece shapes. ``size=None`` (or ``size >= length`` with no ``out``) calls ``fn``
    once; so does an axis of ``length`` 0, over the empty slice (with ``out``, ``out`` is
    returned untouched). With ``recompute`` and grad on, each piece is a non-reentrant
    ``torch.utils.checkpoint``: backward reruns ``fn`` one piece at a time instead of keeping
    every piece's activations. Tensors ``fn`` reads go in ``args``, not in its closure: a
    checkpoint saves its arguments as autograd does (so an enclosing block checkpoint drops and
    recomputes them too) but would keep closure tensors alive with the graph.

    With ``split``, ``args[0]`` is split once along its axis ``split`` into pieces of ``size``
    and ``fn`` receives that piece in its place (``fn(sl, piece, *args[1:])``): its gradient
    is then gathered once from chunk-sized pieces, where a slice per chunk makes a zero-filled
    whole-size gradient for every chunk.
    """
    size = check_chunk_size(size)
    if length < 0:
        raise ValueError(f"the chunked axis cannot have a negative length, got {length}")
    if length == 0:  # an empty axis (e.g. an MSA of no rows): one call over the empty slice
        return fn(slice(0, 0), *args) if out is None else out

    step = length if size is None else size
    pieces = None if split is None else args[0].split(step, split)

    def piece(sl: slice) -> torch.Tensor:
        given = args if pieces is None else (pieces[sl.start // step], *args[1:])
        if recompute and torch.is_grad_enabled():
            return checkpoint(fn, sl, *given, use_reentrant=False)
        return fn(sl, *given)

    if out is None and (size is None or size >= length):
        return piece(slice(0, length))
    slices = [slice(start, min(start + step, length)) for start in range(0, length, step)]
    for number, sl in enumerate(slices):
        part = piece(sl)
        if out is None and part.requires_grad:
            return torch.cat([part, *(piece(rest) for rest in slices[number + 1 :])], dim)
        if out is None:
            shape = list(part.shape)
            shape[dim] = length
            out = part.new_empty(shape)
        index = (slice(None),) * (dim % out.dim()) + (sl,)
        if accumulate:
            out[index] += part
        else:
            out[index] = part
    return out


def chunk_recompute(module: nn.Module, size: int | None) -> bool:
    """Whether ``module`` recomputes its chunks in backward: it is chunked and its plan asks for
    "block" recompute (so a recomputed block keeps one chunk's activations at a time)."""
    plan = getattr(module, "plan", None)
    return size is not None and plan is not None and plan.recompute == "block"


UNPLANNED_WHEN_NONE = ("outer_product", "msa")
"""Plan fields whose ``None`` leaves the module's own chunk size (the planner does not plan
them); for the others ``None`` runs the module whole."""


def plan_chunk_size(module: nn.Module, kind: Kind, chunk_size: int | None) -> int | None:
    """The chunk size ``module`` runs with: its plan's field ``kind`` when it has a plan (for
    :data:`UNPLANNED_WHEN_NONE`, when that field is set), else ``chunk_size`` (checked either
    way)."""
    plan = getattr(module, "plan", None)
    size = None if plan is None else getattr(plan, kind)
    if plan is None or (size is None and kind in UNPLANNED_WHEN_NONE):
        return check_chunk_size(chunk_size)
    return check_chunk_size(size)


def inplace_requested(module: nn.Module, inplace_safe: bool) -> bool:
    """Whether in-place inference is asked of ``module``: ``inplace_safe`` or its plan's
    ``inplace``."""
    plan = getattr(module, "plan", None)
    return bool(inplace_safe) or (plan is not None and plan.inplace)


def grad_free(module: nn.Module, *tensors: torch.Tensor) -> bool:
    """Whether nothing ``module`` computes from ``tensors`` is differentiated (grad mode off, or
    no input nor parameter requires grad): only then may it overwrite an input."""
    if not torch.is_grad_enabled():
        return True
    if any(t is not None and t.requires_grad for t in tensors):
        return False
    return not any(p.requires_grad for p in module.parameters())


PLANNED = (
    "PairformerStack",
    "PairformerBlock",
    "MSAModule",
    "MSABlock",
    "MSAStack",
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicationIncoming",
    "TriangleAttention",
    "AttentionPairBias",
    "Transition",
    "OuterProductMean",
    "MSAPairWeightedAveraging",
)
"""The chunked sci-protenix modules a plan is for (named in :func:`apply_plan`'s error)."""


def apply_plan(module: M, plan: MemoryPlan | None) -> M:
    """Set ``plan`` on every sci-protenix module in ``module`` (itself included), and on each
    subclass of one; returns it.

    ``None`` clears the plans (the modules then follow their ``chunk_size`` arguments). A
    ``module`` holding no sci-protenix module is a ValueError naming the classes it looks for
    (a Protenix model takes a plan through :func:`sci_protenix.boost`).
    """
    if plan is not None and not isinstance(plan, MemoryPlan):
        raise TypeError(
            f"plan must be a sci_protenix.MemoryPlan or None, got {type(plan).__name__}; "
            f"make one with sci_protenix.plan(tokens=..., budget=...) or MemoryPlan(...)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"apply_plan needs an nn.Module, got {type(module).__name__}")
    ours = [
        sub
        for sub in module.modules()
        if any(cls.__module__.startswith("sci_protenix.") for cls in type(sub).__mro__)
    ]
    if not ours:
        raise ValueError(
            f"apply_plan found no sci-protenix module in {type(module).__name__}; it sets the "
            f"plan of sci_protenix's {', '.join(PLANNED)} (and subclasses of them). For a "
            f"Protenix model, swap its modules and apply the plan with "
            f"sci_protenix.boost(model, plan)"
        )
    for sub in ours:
        sub.plan = plan  # a subclass of one (a user's own stack) takes it too
    return module
