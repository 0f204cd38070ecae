"""Linear and layer-norm layers with AlphaFold3's initialisations, and the shared input checks.

:class:`Linear` is a plain :class:`torch.nn.Linear` (parameters ``weight`` and ``bias``) whose
``init`` picks AF3's starting values: ``"default"`` (LeCun truncated normal), ``"relu"`` (He
truncated normal), ``"gating"`` (weights 0, bias 1) or ``"final"`` (all 0) — those Protenix's
layers use, so a module built here starts where Protenix's does. :func:`layer_norm` is
:class:`torch.nn.LayerNorm` with Protenix's ``create_scale``/``create_offset`` switches.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import torch
from torch import nn

Init = Literal["default", "relu", "gating", "final"]

_TRUNC_STD = 0.87962566103423978
"""Standard deviation of a unit normal truncated to [-2, 2]."""


class Linear(nn.Linear):
    """``nn.Linear`` initialised as AF3 does (see the module docstring)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, init: Init = "default"
    ):
        super().__init__(in_features, out_features, bias=bias)
        with torch.no_grad():
            if init in ("default", "relu"):
                gain = 2.0 if init == "relu" else 1.0
                std = math.sqrt(gain / max(1, in_features)) / _TRUNC_STD
                nn.init.trunc_normal_(self.weight, std=std, a=-2 * std, b=2 * std)
            elif init in ("gating", "final"):
                self.weight.zero_()
            else:
                raise ValueError(
                    f"init must be 'default', 'relu', 'gating' or 'final', got {init!r}"
                )
            if self.bias is not None:
                self.bias.fill_(1.0 if init == "gating" else 0.0)


def layer_norm(c: int, create_scale: bool = True, create_offset: bool = True) -> nn.LayerNorm:
    """Layer norm over the last ``c`` channels (eps 1e-5) with optional scale and offset."""
    return nn.LayerNorm(c, eps=1e-5, elementwise_affine=create_scale, bias=create_offset)


def check_channels(
    name: str,
    x: torch.Tensor,
    channels: int,
    what: str,
    min_dim: int,
    module: nn.Module | None = None,
) -> None:
    """A TypeError naming ``name`` unless ``x`` is a floating-point tensor of a dtype of
    ``module``'s parameters (any, under autocast), a ValueError unless it has ``min_dim`` dims
    and ``channels`` last."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()} if module else set()
    if dtypes and x.dtype not in dtypes and not _autocast(x.device.type):
        wanted = " or ".join(sorted(map(str, dtypes)))
        raise TypeError(
            f"{name} is {x.dtype} and the module's parameters are {wanted}: cast one to the "
            f"other ({name}.to(...) or module.to({x.dtype})), or run under torch.autocast"
        )
    if x.dim() < min_dim or x.shape[-1] != channels:
        raise ValueError(
            f"{name} must be {what} with {channels} channels last, got shape {tuple(x.shape)}; "
            f"build the module with the channel count of the input"
        )


def _autocast(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (one it does not know, e.g. meta: no)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def check_blocks(n_blocks: Any) -> None:
    """A ValueError unless ``n_blocks`` is an int >= 0 (0: the module returns its input)."""
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 0:
        raise ValueError(f"n_blocks must be an int >= 0, got {n_blocks!r}")


def check_blocks_per_ckpt(blocks_per_ckpt: Any) -> None:
    """A ValueError unless ``blocks_per_ckpt`` (Protenix's keyword) is an int >= 1 (blocks per
    recomputed segment) or None (no recompute)."""
    if blocks_per_ckpt is not None and (
        isinstance(blocks_per_ckpt, bool)
        or not isinstance(blocks_per_ckpt, int)
        or blocks_per_ckpt < 1
    ):
        raise ValueError(
            f"blocks_per_ckpt must be an int >= 1 (blocks per recomputed segment) or None "
            f"(no recompute), got {blocks_per_ckpt!r}"
        )


def check_dropout(p: Any, name: str = "dropout") -> None:
    """A ValueError unless the dropout probability ``p`` (the argument ``name``) is a real
    number in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p < 1.0:
        raise ValueError(
            f"{name} must be a float in [0, 1) (the probability of dropping), got {p!r}"
        )


def check_square(name: str, z: torch.Tensor) -> None:
    """Raise a ValueError unless the pair tensor ``z`` is [*, N, N, c]."""
    if z.shape[-3] != z.shape[-2]:
        raise ValueError(f"{name} must be square [*, N, N, c], got shape {tuple(z.shape)}")


def broadcast(*shapes: tuple[int, ...]) -> torch.Size | None:
    """The shape ``shapes`` broadcast to together, or None where they do not.

    Plain Python over the sizes, not ``torch.broadcast_shapes``: under ``torch.compile`` that
    one's error is raised while dynamo traces it, as a ``TorchRuntimeError``, before the caller
    can turn it into its own ``ValueError``.
    """
    out = [1] * max([0, *map(len, shapes)])
    for shape in shapes:
        for i, size in enumerate(shape, start=len(out) - len(shape)):
            if size == 1 or size == out[i]:
                continue
            if out[i] != 1:
                return None
            out[i] = size
    return torch.Size(out)


def check_pair_for(name: str, x: torch.Tensor, z: torch.Tensor) -> None:
    """A ValueError unless ``z`` is [*, N, N, c] with the N of ``x`` [*, N, c] and batch dims
    that broadcast to ``x``'s (the update made from both has ``x``'s shape)."""
    n = x.shape[-2]
    if z.shape[-3:-1] != (n, n):
        raise ValueError(
            f"z must be [..., N, N, c_z] with {name}'s N = {n}, got z {tuple(z.shape)} for "
            f"{name} {tuple(x.shape)}; pass the single and pair representations of one complex"
        )
    if broadcast(z.shape[:-3], x.shape[:-2]) != x.shape[:-2]:
        raise ValueError(
            f"z's batch dims {tuple(z.shape[:-3])} must broadcast to {name}'s "
            f"{tuple(x.shape[:-2])}: the update has {name}'s shape; give {name} z's batch dims, "
            f"e.g. {name}.expand(*z.shape[:-3], *{name}.shape[-2:])"
        )


def check_mask(mask: torch.Tensor | None, shape: torch.Size, what: str) -> None:
    """Raise a ValueError unless ``mask`` is None or broadcasts to ``shape``."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if broadcast(mask.shape, shape) != shape:
        raise ValueError(
            f"mask must be {what} (broadcasting to {tuple(shape)}), got shape {tuple(mask.shape)}"
        )
