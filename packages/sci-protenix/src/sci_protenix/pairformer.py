"""`PairformerBlock` and `PairformerStack` (AF3 algorithm 17) with chunking, in-place inference
and per-block recompute.

A block updates the pair tensor z [*, N, N, c_z] by triangle multiplication (outgoing, incoming),
triangle attention (starting, ending node) and a transition, then the single tensor s [*, N, c_s]
by attention with pair bias and a transition. ``chunk_size`` reaches every module (each takes its
own from its plan when one is set). In-place inference (``inplace_safe`` or ``plan.inplace``,
with no gradient needed and no dropout active) adds every update into z chunk by chunk: the
caller's z is overwritten.

The stack's recompute comes from its plan (``recompute``: "none", "block": each segment of
``blocks_per_checkpoint`` blocks rerun in backward, "selective": the same segments, keeping the
outputs of matrix products and of the fused attention and recomputing the rest), else from
Protenix's ``blocks_per_ckpt`` ("block" recompute when set); it only applies while grad is on.
Under a plan's "block" recompute each pair module of a block is a nested checkpoint as well:
a segment's rerun keeps only the modules' inputs, and each module reruns in its own backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from sci_protenix.attention import AttentionPairBias
from sci_protenix.chunking import grad_free, inplace_requested
from sci_protenix.memory_plan import SELECTIVE_SAVE_OPS, MemoryPlan
from sci_protenix.primitives import (
    check_blocks,
    check_blocks_per_ckpt,
    check_channels,
    check_dropout,
    check_pair_for,
)
from sci_protenix.transition import Transition
from sci_protenix.triangle import (
    TriangleAttention,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)


def dropout_add(
    residual: torch.Tensor, x: torch.Tensor, p: float, training: bool, shared_dim: int
) -> torch.Tensor:
    """``residual + x * mask`` with one dropout mask shared along ``shared_dim`` (-3: AF3's
    row-wise dropout, -2: column-wise); plain ``residual + x`` outside training or at ``p = 0``."""
    if not training or p == 0.0:
        return residual + x
    shape = list(x.shape)
    shape[shared_dim] = 1
    return residual + x * F.dropout(x.new_ones(shape), p=p, training=True)


def _keep(saved: frozenset[str], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recompute: keep the outputs of the ops named in ``saved`` (an op, every
    overload of it: ``aten::mul``; or one overload: ``aten::mul.Tensor``), recompute the rest."""
    if op._schema.name in saved or op.name() in saved:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def recompute_policy(module: nn.Module) -> tuple[str, int]:
    """The recompute policy and blocks per segment a stack (``module``, with ``plan`` and
    Protenix's ``blocks_per_ckpt``) trains with: its plan's, else "block" per
    ``blocks_per_ckpt`` when that is set, else "none"."""
    plan = getattr(module, "plan", None)
    if plan is not None:
        return plan.recompute, plan.blocks_per_checkpoint
    if module.blocks_per_ckpt is not None:
        return "block", module.blocks_per_ckpt
    return "none", 1


def save_ops(module: nn.Module) -> tuple[str, ...]:
    """The ops whose outputs ``module``'s selective recompute keeps: its plan's, else the
    default (matrix products and the fused attention)."""
    plan = getattr(module, "plan", None)
    return SELECTIVE_SAVE_OPS if plan is None else plan.save_ops


class PairformerBlock(nn.Module):
    """One Pairformer block (AF3 algorithm 17, lines 2-8), Protenix's constructor and names.

    ``tri_att_end`` is a ``TriangleAttention(starting=False)`` working on z's transpose view,
    where Protenix builds a starting-node one and transposes z around it (same parameters, same
    result, no transposed copies of z). ``hidden_scale_up`` sets ``no_heads_pair = c_z //
    c_hidden_pair_att`` and ``c_hidden_mul = c_z`` as Protenix does.
    """

    plan: MemoryPlan | None = None

    def __init__(
        self,
        n_heads: int = 16,
        c_z: int = 128,
        c_s: int = 384,
        c_hidden_mul: int = 128,
        c_hidden_pair_att: int = 32,
        no_heads_pair: int = 4,
        num_intermediate_factor: int = 4,
        dropout: float = 0.25,
        hidden_scale_up: bool = False,
    ) -> None:
        super().__init__()
        check_dropout(dropout)
        if c_s > 0 and (n_heads < 1 or c_s % n_heads):
            raise ValueError(
                f"c_s ({c_s}) must be a multiple of n_heads ({n_heads}), n_heads >= 1: attention "
                f"with pair bias splits c_s into n_heads heads; pick an n_heads that divides c_s"
            )
        if hidden_scale_up:
            no_heads_pair = c_z // c_hidden_pair_att
            c_hidden_mul = c_z
        self.n_heads = n_heads
        self.c_z = c_z
        self.c_s = c_s
        self.p_drop = dropout
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z=c_z, c_hidden=c_hidden_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z=c_z, c_hidden=c_hidden_mul)
        self.tri_att_start = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair)
        self.tri_att_end = TriangleAttention(c_z, c_hidden_pair_att, no_heads_pair, starting=False)
        self.pair_transition = Transition(c_in=c_z, n=num_intermediate_factor)
        if c_s > 0:
            self.attention_pair_bias = AttentionPairBias(
                has_s=False, create_offset_ln_z=True, n_heads=n_heads, c_a=c_s, c_z=c_z
            )
            self.single_transition = Transition(c_in=c_s, n=4)

    def forward(
        self,
        s: torch.Tensor | None,
        z: torch.Tensor,
        pair_mask: torch.Tensor | None,
        triangle_multiplicative: str = "torch",
        triangle_attention: str = "torch",
        inplace_safe: bool = False,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Updated ``(s, z)`` for ``s`` [*, N, c_s] (None when ``c_s = 0``), ``z`` [*, N, N, c_z]
        and ``pair_mask`` [*, N, N] or None. The kernel-choice strings are accepted and ignored."""
        check_channels("z", z, self.c_z, "[*, N, N, c_z]", 3, self)
        if self.c_s > 0:
            if s is None:
                raise ValueError(f"s [*, N, c_s={self.c_s}] is required when c_s > 0, got None")
            check_channels("s", s, self.c_s, "[*, N, c_s]", 2, self)
            check_pair_for("s", s, z)
        mask = pair_mask
        dropping = self.training and self.p_drop > 0.0
        if not dropping and inplace_requested(self, inplace_safe) and grad_free(self, s, z):
            inplace = {"inplace_safe": True, "_add_with_inplace": True}
            z = self.tri_mul_out(z, mask=mask, chunk_size=chunk_size, **inplace)
            z = self.tri_mul_in(z, mask=mask, chunk_size=chunk_size, **inplace)
            z = self.tri_att_start(z, mask=mask, chunk_size=chunk_size, **inplace)
            z = self.tri_att_end(z, mask=mask, chunk_size=chunk_size, **inplace)
            z = self.pair_transition(z, chunk_size=chunk_size, **inplace)
        else:
            p, step = self.p_drop, self._step
            z = step(lambda z: self.tri_mul_out(z, mask, chunk_size=chunk_size), z, p, -3)
            z = step(lambda z: self.tri_mul_in(z, mask, chunk_size=chunk_size), z, p, -3)
            z = step(lambda z: self.tri_att_start(z, mask, chunk_size), z, p, -3)
            z = step(lambda z: self.tri_att_end(z, mask, chunk_size), z, p, -2)
            z = step(lambda z: self.pair_transition(z, chunk_size=chunk_size), z, 0.0, -3)
        if self.c_s > 0:
            s = s + self.attention_pair_bias(a=s, s=None, z=z, chunk_size=chunk_size)
            s = s + self.single_transition(s, chunk_size=chunk_size)
        return s, z

    def _step(
        self, update: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, p: float, dim: int
    ) -> torch.Tensor:
        """``z`` plus ``update(z)`` (dropped out at ``p``, mask shared along ``dim``). Under a
        plan with "block" recompute and grad on, one non-reentrant checkpoint: autograd keeps
        only ``z`` and the module reruns in its own backward, so its whole-size intermediates
        (a triangle multiplication's far projection, the chunk outputs) and their gradients
        exist during that module's backward alone."""

        def residual(z: torch.Tensor) -> torch.Tensor:
            return dropout_add(z, update(z), p, self.training, dim)

        plan = self.plan
        if plan is not None and plan.recompute == "block" and torch.is_grad_enabled():
            return checkpoint(residual, z, use_reentrant=False)
        return residual(z)


class PairformerStack(nn.Module):
    """``n_blocks`` Pairformer blocks (AF3 algorithm 17), Protenix's constructor and names."""

    plan: MemoryPlan | None = None

    def __init__(
        self,
        n_blocks: int = 48,
        n_heads: int = 16,
        c_z: int = 128,
        c_s: int = 384,
        num_intermediate_factor: int = 4,
        dropout: float = 0.25,
        blocks_per_ckpt: int | None = None,
        hidden_scale_up: bool = False,
    ) -> None:
        super().__init__()
        check_blocks(n_blocks)
        check_blocks_per_ckpt(blocks_per_ckpt)
        self.n_blocks = n_blocks
        self.n_heads = n_heads
        self.blocks_per_ckpt = blocks_per_ckpt
        self.blocks = nn.ModuleList(
            PairformerBlock(
                n_heads=n_heads,
                c_z=c_z,
                c_s=c_s,
                num_intermediate_factor=num_intermediate_factor,
                dropout=dropout,
                hidden_scale_up=hidden_scale_up,
            )
            for _ in range(n_blocks)
        )

    def recompute(self) -> tuple[str, int]:
        """:func:`recompute_policy` of this stack."""
        return recompute_policy(self)

    def forward(
        self,
        s: torch.Tensor | None,
        z: torch.Tensor,
        pair_mask: torch.Tensor | None,
        triangle_multiplicative: str = "torch",
        triangle_attention: str = "torch",
        inplace_safe: bool = False,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(s, z)`` after every block; arguments as :meth:`PairformerBlock.forward`."""
        blocks = [
            functools.partial(
                block, pair_mask=pair_mask, inplace_safe=inplace_safe, chunk_size=chunk_size
            )
            for block in self.blocks
        ]
        return run_blocks(blocks, s, z, *self.recompute(), save_ops(self))


Blocks = list[Callable[[Any, torch.Tensor], tuple[Any, torch.Tensor]]]


def run_blocks(
    blocks: Blocks,
    s: Any,
    z: torch.Tensor,
    policy: str,
    per: int,
    saved: tuple[str, ...] = SELECTIVE_SAVE_OPS,
) -> tuple[Any, torch.Tensor]:
    """``(s, z)`` through ``blocks`` (each ``block(s, z) -> (s, z)``) in turn, recomputed by
    ``policy`` ("none", "block" or "selective") in segments of ``per`` blocks while grad is on
    (``per`` is checked only then, as Protenix's ``checkpoint_blocks`` checks it).

    The one block runner of the Pairformer and MSA stacks: "block" reruns each segment in
    backward (``torch.utils.checkpoint``, non-reentrant; dropout masks replayed), "selective"
    does the same but keeps the outputs of the ops named in ``saved`` (by default matrix
    products and the fused attention).
    """
    if policy not in ("none", "block", "selective"):
        raise ValueError(f"recompute policy must be 'none', 'block' or 'selective', got {policy!r}")
    if policy == "none" or not torch.is_grad_enabled():
        return _run(blocks, s, z)
    if per < 1:
        raise ValueError(f"blocks per recomputed segment must be >= 1, got {per}")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, functools.partial(_keep, frozenset(saved))
        )
    for start in range(0, len(blocks), per):
        s, z = checkpoint(_run, blocks[start : start + per], s, z, **kwargs)
    return s, z


def _run(blocks: Blocks, s: Any, z: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """Blocks in turn on ``(s, z)``: one recomputed segment."""
    for block in blocks:
        s, z = block(s, z)
    return s, z
