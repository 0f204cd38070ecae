"""MSA modules of AlphaFold3's MSA module (supplement algorithms 8-10), laid out as Protenix's.

:class:`OuterProductMean` (algorithm 9) sends the MSA into the pair representation;
:class:`MSAPairWeightedAveraging` (algorithm 10) sends the pair representation into the MSA.
Parameter names, constructor keywords and call keywords are Protenix 2.0.0's, so their state
dicts load into these with ``strict=True``. Memory: the outer product mean works on chunks of
output rows ``i``, so its [N, N, c, c] outer product only ever exists for ``chunk_size`` rows; the
pair-weighted averaging works on chunks of MSA rows, so its per-sequence values, gates and
weighted sums only ever exist for ``chunk_size`` sequences. Chunk sizes come from the module's
``plan`` (fields ``outer_product`` and ``msa``) when it has one, else from the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sci_protenix.chunking import chunked, grad_free, inplace_requested, plan_chunk_size
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.primitives import Linear, check_channels, check_mask, check_square, layer_norm
from sci_protenix.transition import Transition


class OuterProductMean(nn.Module):
    """Pair update ``linear_out(mean_s a[s, i] ⊗ b[s, j])`` from an MSA ``m`` [*, S, N, c_m].

    As Protenix (and OpenFold): ``a``, ``b`` are ``linear_1``/``linear_2`` of the layer-normed
    MSA times the MSA mask, the flattened outer product goes through ``linear_out`` (with bias)
    and the result is divided by ``sum_s mask[s, i] * mask[s, j] + eps``. Chunks are rows ``i``
    of the [*, N, N, c_z] output (plan field ``outer_product``).
    """

    plan: MemoryPlan | None = None

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.c_m = c_m
        self.c_z = c_z
        self.c_hidden = c_hidden
        self.eps = eps
        self.layer_norm = layer_norm(c_m)
        self.linear_1 = Linear(c_m, c_hidden, bias=False)
        self.linear_2 = Linear(c_m, c_hidden, bias=False)
        self.linear_out = Linear(c_hidden**2, c_z, init="final")

    def forward(
        self,
        m: torch.Tensor,
        mask: torch.Tensor | None = None,
        chunk_size: int | None = None,
        inplace_safe: bool = False,
    ) -> torch.Tensor:
        """The pair update [*, N, N, c_z] for ``m`` [*, S, N, c_m] and ``mask`` [*, S, N] or None.

        ``inplace_safe`` is accepted for Protenix's call signature; each chunk is already
        normalised where it is written, so there is nothing to do in place.
        """
        del inplace_safe
        check_channels("m", m, self.c_m, "an MSA [*, S, N, c_m]", 3)
        check_mask(mask, m.shape[:-1], "an MSA mask [*, S, N]")
        size = plan_chunk_size(self, "outer_product", chunk_size)
        normed = self.layer_norm(m)
        a = self.linear_1(normed)
        b = self.linear_2(normed)
        del normed
        if mask is None:
            norm: torch.Tensor | float = m.shape[-3] + self.eps
        else:
            weight = mask.to(a.dtype).expand(m.shape[:-1])
            a = a * weight.unsqueeze(-1)
            b = b * weight.unsqueeze(-1)
            norm = torch.einsum("...si,...sj->...ij", weight, weight).unsqueeze(-1) + self.eps
        a = a.transpose(-2, -3)  # [*, N, S, c]: rows i first
        b = b.transpose(-2, -3)

        def rows(sl: slice) -> torch.Tensor:
            outer = torch.einsum("...isc,...jse->...ijce", a[..., sl, :, :], b)
            update = self.linear_out(outer.flatten(-2))
            del outer
            if isinstance(norm, torch.Tensor):
                return update / norm[..., sl, :, :]
            return update / norm

        return chunked(rows, a.shape[-3], size, -3)


class MSAPairWeightedAveraging(nn.Module):
    """MSA update: per head, rows of values averaged with weights ``softmax_j(b_ij)`` from the pair
    representation, gated, projected back to ``c_m`` (AF3 algorithm 10, as Protenix).

    The weights [*, N, N, n_heads] are computed once per call; chunks are MSA rows (sequences,
    plan field ``msa``).
    """

    plan: MemoryPlan | None = None

    def __init__(self, c_m: int = 64, c: int = 32, c_z: int = 128, n_heads: int = 8) -> None:
        super().__init__()
        self.c_m = c_m
        self.c = c
        self.c_z = c_z
        self.n_heads = n_heads
        self.layernorm_m = layer_norm(c_m)
        self.linear_no_bias_mv = Linear(c_m, c * n_heads, bias=False)
        self.layernorm_z = layer_norm(c_z)
        self.linear_no_bias_z = Linear(c_z, n_heads, bias=False)
        self.linear_no_bias_mg = Linear(c_m, c * n_heads, bias=False, init="final")
        self.linear_no_bias_out = Linear(c * n_heads, c_m, bias=False, init="final")

    def pair_weights(self, z: torch.Tensor) -> torch.Tensor:
        """The averaging weights [*, N, N, n_heads] (softmax over the second token) from ``z``."""
        check_channels("z", z, self.c_z, "a pair tensor [*, N, N, c_z]", 3)
        check_square("z", z)
        return torch.softmax(self.linear_no_bias_z(self.layernorm_z(z)), dim=-2)

    def row_update(self, m: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The update of MSA rows ``m`` [*, s, N, c_m] given :meth:`pair_weights`."""
        normed = self.layernorm_m(m)
        values = self.linear_no_bias_mv(normed).unflatten(-1, (self.n_heads, self.c))
        gates = torch.sigmoid(self.linear_no_bias_mg(normed)).unflatten(-1, (self.n_heads, self.c))
        del normed
        averaged = torch.einsum("...ijh,...sjhc->...sihc", weights, values)
        return self.linear_no_bias_out((gates * averaged).flatten(-2))

    def check_inputs(self, m: torch.Tensor, z: torch.Tensor) -> None:
        """ValueError unless ``m`` is [*, S, N, c_m] and ``z`` [*, N, N, c_z] with the same N."""
        check_channels("m", m, self.c_m, "an MSA [*, S, N, c_m]", 3)
        check_channels("z", z, self.c_z, "a pair tensor [*, N, N, c_z]", 3)
        check_square("z", z)
        if z.shape[-2] != m.shape[-2]:
            raise ValueError(
                f"m has {m.shape[-2]} tokens (shape {tuple(m.shape)}) but z has {z.shape[-2]} "
                f"(shape {tuple(z.shape)}); pass the MSA and pair tensors of one complex"
            )

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        chunk_size: int | None = None,
        inplace_safe: bool = False,
    ) -> torch.Tensor:
        """The MSA update [*, S, N, c_m] for ``m`` [*, S, N, c_m] and ``z`` [*, N, N, c_z].

        ``chunk_size`` (MSA rows per chunk) and ``inplace_safe`` are extras to Protenix's
        ``forward(m, z)``; the update is a new tensor either way, so ``inplace_safe`` is unused.
        """
        del inplace_safe
        self.check_inputs(m, z)
        size = plan_chunk_size(self, "msa", chunk_size)
        weights = self.pair_weights(z)
        return chunked(lambda sl: self.row_update(m[..., sl, :, :], weights), m.shape[-3], size, -3)


class MSAStack(nn.Module):
    """MSA rows updated by pair-weighted averaging, then a transition (AF3 algorithm 8, lines 7-8).

    As Protenix's ``MSAStack``: ``m += dropout_rowwise(msa_pair_weighted_averaging(m, z))``, then
    ``m += transition_m(m)``, both over chunks of ``msa_chunk_size`` MSA rows (plan field ``msa``
    overrides it). The averaging weights are computed once per call, not once per chunk. Unlike
    Protenix's training path, the MSA is not padded to ``msa_max_size`` (the padding only kept
    DDP's graph static; the real rows' results are the same); ``msa_max_size`` is kept for
    reference. In inference with ``inplace_safe`` (or ``plan.inplace``) and no gradient needed,
    each chunk's result is written back into ``m``, as Protenix's inference path does.
    """

    plan: MemoryPlan | None = None

    def __init__(
        self,
        c_m: int = 64,
        c_z: int = 128,
        c: int = 8,
        dropout: float = 0.15,
        msa_chunk_size: int | None = 2048,
        msa_max_size: int | None = 16384,
    ) -> None:
        super().__init__()
        self.c = c
        self.p_drop = dropout
        self.msa_chunk_size = msa_chunk_size
        self.msa_max_size = msa_max_size
        self.msa_pair_weighted_averaging = MSAPairWeightedAveraging(c_m=c_m, c=c, c_z=c_z)
        self.transition_m = Transition(c_in=c_m, n=4)

    def forward(self, m: torch.Tensor, z: torch.Tensor, inplace_safe: bool = False) -> torch.Tensor:
        """The updated MSA [*, S, N, c_m] for ``m`` [*, S, N, c_m] and ``z`` [*, N, N, c_z]."""
        averaging = self.msa_pair_weighted_averaging
        averaging.check_inputs(m, z)
        size = plan_chunk_size(self, "msa", self.msa_chunk_size)
        weights = averaging.pair_weights(z)
        keep = None
        if self.training and self.p_drop > 0:
            rowwise = m.new_ones(*m.shape[:-3], 1, *m.shape[-2:])
            keep = F.dropout(rowwise, self.p_drop, training=True)
        inplace = inplace_requested(self, inplace_safe) and grad_free(self, m, z)

        def rows(sl: slice) -> torch.Tensor:
            part = m[..., sl, :, :]
            update = averaging.row_update(part, weights)
            part = part + (update if keep is None else update * keep)
            return part + self.transition_m(part)

        return chunked(rows, m.shape[-3], size, -3, out=m if inplace else None)
