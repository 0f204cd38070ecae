"""`MemoryPlan`: how a Pairformer runs within a memory budget (chunk sizes and recompute).

Made by :func:`sci_protenix.plan` from a token count and a budget, or written by hand; the
modules read it from their ``plan`` attribute (set by :func:`sci_protenix.apply_plan`). A chunk
size of ``None`` runs that module whole, except for the MSA module's ``outer_product`` and
``msa``, which the planner does not plan: there ``None`` leaves the module's own chunk size.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

import spore_kernels  # noqa: F401  (defines the spore ops save_ops may name)

ChunkSize = StrictInt | None
"""A chunk size: an int (not a bool, which pydantic would take as 1), or None."""

SELECTIVE_SAVE_OPS = (
    "aten::mm",
    "aten::bmm",
    "aten::addmm",
    "aten::baddbmm",
    "spore::triangle_attention",
)
"""What 'selective' recompute keeps by default: matrix products and the fused attention."""


class MemoryPlan(BaseModel):
    """Chunk sizes per module kind and the recompute policy of a Pairformer/MSA stack."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tri_mul: ChunkSize = Field(None, gt=0, description="output rows per chunk: triangle mult.")
    tri_att: ChunkSize = Field(None, gt=0, description="rows per chunk: triangle attention")
    transition: ChunkSize = Field(None, gt=0, description="rows per chunk: transitions")
    pair_bias: ChunkSize = Field(None, gt=0, description="queries per chunk: pair-bias attention")
    outer_product: ChunkSize = Field(
        None, gt=0, description="rows per chunk: outer product mean (None: the call's chunk_size)"
    )
    msa: ChunkSize = Field(
        None,
        gt=0,
        description="MSA rows per chunk: pair-weighted averaging (None: the module's own, e.g. "
        "MSAStack's msa_chunk_size)",
    )
    recompute: Literal["none", "block", "selective"] = Field(
        "none",
        description="training: keep every activation ('none'); recompute each block in "
        "backward, and inside it each chunk of a chunked module ('block'); or recompute all "
        "but the matmul outputs ('selective')",
    )
    blocks_per_checkpoint: StrictInt = Field(1, gt=0, description="blocks per recomputed segment")
    save_ops: tuple[str, ...] = Field(
        SELECTIVE_SAVE_OPS,
        description="'selective': the ops whose outputs are kept (names as torch reports "
        "them: 'aten::mm', or one overload, 'aten::mul.Tensor'; an op's name covers its "
        "overloads); every other op is recomputed",
    )
    inplace: StrictBool = Field(False, description="inference only: accumulate residuals in place")

    @field_validator("save_ops")
    @classmethod
    def _known_ops(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        """Each name as :func:`op_name` reads it."""
        return tuple(op_name(name) for name in names)


def op_name(given: str) -> str:
    """``given`` as selective recompute matches it (``OpOverload.name()``): an op, every
    overload of it (``aten::mul``; a bare ``mul`` is ``aten::mul``), or one overload
    (``aten::mul.Tensor``; ``.default`` is the op's own name). A ValueError unless it names an
    op or overload that exists: a name that matches nothing would keep nothing, silently."""
    name = given if "::" in given else f"aten::{given}"
    namespace, _, op = name.partition("::")
    packet, dot, overload = op.partition(".")
    try:
        found = getattr(getattr(torch.ops, namespace), packet)
    except (AttributeError, RuntimeError):
        found = None
    if (
        not isinstance(found, torch._ops.OpOverloadPacket)  # a namespace's attribute
        or (dot and overload not in found.overloads())
    ):
        raise ValueError(
            f"save_ops: no op {name!r}; give names as torch reports them, e.g. "
            f"{', '.join(map(repr, SELECTIVE_SAVE_OPS))}"
        )
    return f"{namespace}::{packet}" if overload == "default" else name
