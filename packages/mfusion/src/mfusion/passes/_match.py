"""What the pattern passes' checks read from a match: the fake values of its arguments and output.

Inductor's matcher first matches a form's structure ignoring scalars, shapes and dtypes, then
retraces the form on the matched values and requires that graph too, so scalar constants
(GELU's 0.044715), slice bounds and cast dtypes are compared exactly; a check adds what the
spore op requires of dtypes and shapes.
"""

from __future__ import annotations

from typing import Any

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
NARROW_FLOATS = (torch.bfloat16, torch.float16)


def value(match: Any, name: str) -> Any:
    """The fake value (``meta["val"]``) of the match's argument ``name``, or None."""
    node = match.kwargs.get(name)
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def output_value(match: Any) -> Any:
    """The fake value of the matched subgraph's output."""
    return match.output_nodes()[0].meta.get("val")


def floating(*values: Any) -> bool:
    """Every value is a tensor of one floating dtype spore's ops take."""
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    return values[0].dtype in FLOATS and all(v.dtype == values[0].dtype for v in values)


def rounds_as_eager(*values: Any) -> bool:
    """Inductor is told to round 16-bit intermediates as eager does
    (``emulate_precision_casts``) and a value is 16-bit: a rewrite into one op that rounds once
    would then differ from both eager and plain Inductor."""
    from torch._inductor import config

    return bool(config.emulate_precision_casts) and any(
        isinstance(v, torch.Tensor) and v.dtype in NARROW_FLOATS for v in values
    )
