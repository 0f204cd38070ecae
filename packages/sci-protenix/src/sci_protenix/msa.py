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

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sci_protenix.chunking import (
    check_chunk_size,
    chunked,
    grad_free,
    inplace_requested,
    plan_chunk_size,
)
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.pairformer import PairformerBlock, recompute_policy, run_blocks, save_ops
from sci_protenix.primitives import (
    Linear,
    broadcast,
    check_blocks,
    check_blocks_per_ckpt,
    check_channels,
    check_dropout,
    check_mask,
    check_square,
    layer_norm,
)
from sci_protenix.transition import Transition


def check_msa_and_pair(m: torch.Tensor, z: torch.Tensor, module: nn.Module) -> None:
    """ValueError unless ``m`` is [*, S, N, module.c_m] and ``z`` [*, N, N, module.c_z] with the
    same N and batch dims that broadcast together."""
    check_channels("m", m, module.c_m, "an MSA [*, S, N, c_m]", 3, module)
    check_channels("z", z, module.c_z, "a pair tensor [*, N, N, c_z]", 3, module)
    check_square("z", z)
    if z.shape[-2] != m.shape[-2]:
        raise ValueError(
            f"m has {m.shape[-2]} tokens (shape {tuple(m.shape)}) but z has {z.shape[-2]} "
            f"(shape {tuple(z.shape)}); pass the MSA and pair tensors of one complex"
        )
    if broadcast(m.shape[:-3], z.shape[:-3]) is None:
        raise ValueError(
            f"m's batch dims {tuple(m.shape[:-3])} and z's {tuple(z.shape[:-3])} do not "
            f"broadcast (m {tuple(m.shape)}, z {tuple(z.shape)}); give both the same batch dims"
        )


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
        check_channels("m", m, self.c_m, "an MSA [*, S, N, c_m]", 3, self)
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
        check_channels("z", z, self.c_z, "a pair tensor [*, N, N, c_z]", 3, self)
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
        """ValueError unless ``m`` is [*, S, N, c_m] and ``z`` [*, N, N, c_z] with the same N and
        batch dims that broadcast together (:func:`check_msa_and_pair`)."""
        check_msa_and_pair(m, z, self)

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


def _only_leading_ones(shape: tuple[int, ...], grown: tuple[int, ...]) -> bool:
    """Whether ``grown`` is ``shape`` with at most leading size-1 dims added (a tensor of
    ``shape`` views as ``grown`` and holds a result of that shape in place)."""
    extra = len(grown) - len(shape)
    return extra >= 0 and tuple(grown[extra:]) == tuple(shape) and set(grown[:extra]) <= {1}


class MSAStack(nn.Module):
    """MSA rows updated by pair-weighted averaging, then a transition (AF3 algorithm 8, lines 7-8).

    As Protenix's ``MSAStack``: ``m += dropout_rowwise(msa_pair_weighted_averaging(m, z))``, then
    ``m += transition_m(m)``, both over chunks of ``msa_chunk_size`` MSA rows (plan field ``msa``
    overrides it). The averaging weights are computed once per call, not once per chunk. Unlike
    Protenix's training path, the MSA is not padded to ``msa_max_size`` (the padding only kept
    DDP's graph static; the real rows' results are the same); ``msa_max_size`` is kept for
    reference. In inference with ``inplace_safe`` (or ``plan.inplace``) and no gradient needed,
    each chunk's result is written back into ``m``, as Protenix's inference path does (when
    ``z``'s batch dims only add leading size-1 dims, the result is a view of ``m`` with them),
    unless ``z``'s batch dims broadcast ``m`` to a larger shape (then it is a new tensor).
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
        check_dropout(dropout)
        self.c = c
        self.p_drop = dropout
        self.msa_chunk_size = check_chunk_size(msa_chunk_size, "msa_chunk_size")
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
        batch = broadcast(m.shape[:-3], z.shape[:-3])
        out = None
        if (
            inplace_requested(self, inplace_safe)
            and grad_free(self, m, z)
            and batch is not None
            and _only_leading_ones(m.shape[:-3], batch)  # rows fit in m's storage
        ):
            out = m if batch == m.shape[:-3] else m.view(*batch, *m.shape[-3:])

        def rows(sl: slice) -> torch.Tensor:
            part = m[..., sl, :, :]
            update = averaging.row_update(part, weights)
            part = part + (update if keep is None else update * keep)
            return part + self.transition_m(part)

        return chunked(rows, m.shape[-3], size, -3, out=out)


class MSABlock(nn.Module):
    """One MSA-module block (AF3 algorithm 8, lines 6-13), Protenix's constructor and names.

    ``z += outer_product_mean_msa(m)``; unless ``is_last_block``, ``m = msa_stack(m, z)``; then
    ``pair_stack`` (a :class:`~sci_protenix.pairformer.PairformerBlock` without single track)
    updates ``z``. Returns ``(m, z)``, or ``(None, z)`` for the last block, as Protenix. With
    in-place inference asked for (``inplace_safe`` or ``plan.inplace``) and no gradient needed,
    the caller's ``m`` and ``z`` are overwritten (a result the other's batch dims only add
    leading size-1 dims to is a view of the input), each unless the other's batch dims broadcast
    it to a larger shape (then its result is a new tensor).
    """

    plan: MemoryPlan | None = None

    def __init__(
        self,
        c_m: int = 64,
        c_z: int = 128,
        c_hidden: int = 32,
        is_last_block: bool = False,
        msa_dropout: float = 0.15,
        pair_dropout: float = 0.25,
        msa_chunk_size: int | None = 2048,
        msa_max_size: int | None = 16384,
        hidden_scale_up: bool = False,
    ) -> None:
        super().__init__()
        check_dropout(msa_dropout, "msa_dropout")
        check_dropout(pair_dropout, "pair_dropout")
        check_chunk_size(msa_chunk_size, "msa_chunk_size")
        self.c_m = c_m
        self.c_z = c_z
        self.c_hidden = c_hidden
        self.is_last_block = is_last_block
        self.outer_product_mean_msa = OuterProductMean(c_m=c_m, c_z=c_z, c_hidden=c_hidden)
        if not is_last_block:
            self.msa_stack = MSAStack(
                c_m=c_m,
                c_z=c_z,
                dropout=msa_dropout,
                msa_chunk_size=msa_chunk_size,
                msa_max_size=msa_max_size,
            )
        self.pair_stack = PairformerBlock(
            c_z=c_z, c_s=0, dropout=pair_dropout, hidden_scale_up=hidden_scale_up
        )

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        pair_mask: torch.Tensor | None,
        triangle_multiplicative: str = "torch",
        triangle_attention: str = "torch",
        inplace_safe: bool = False,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Updated ``(m, z)`` for ``m`` [*, S, N, c_m], ``z`` [*, N, N, c_z] and ``pair_mask``
        [*, N, N] or None; the kernel-choice strings are accepted and ignored."""
        check_msa_and_pair(m, z, self)
        update = self.outer_product_mean_msa(m, chunk_size=chunk_size)
        in_place = inplace_requested(self, inplace_safe) and grad_free(self, m, z)
        shape = broadcast(z.shape, update.shape)
        if in_place and shape is not None and _only_leading_ones(z.shape, shape):
            z = z if shape == z.shape else z.view(shape)
            z += update
        else:
            z = z + update
        del update
        if not self.is_last_block:
            m = self.msa_stack(m, z, inplace_safe=inplace_safe)
        _, z = self.pair_stack(None, z, pair_mask, inplace_safe=inplace_safe, chunk_size=chunk_size)
        return (None if self.is_last_block else m), z


_MSA_FEATURES = {"msa": 32, "has_deletion": 1, "deletion_value": 1}
"""The MSA features the module embeds and their channels (the MSA one-hot over 32 classes)."""


def sampling_configs(msa_configs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Protenix's MSA sampling settings from its data config's ``msa`` section: strategy
    ("random" or "topk"), sample cutoffs and lower bounds for training and test."""
    configs = dict(msa_configs or {})
    strategy = configs.get("strategy", "random")
    if strategy not in ("random", "topk"):
        raise ValueError(f"msa_configs['strategy'] must be 'random' or 'topk', got {strategy!r}")
    cutoff = configs.get("sample_cutoff", {})
    lower = configs.get("min_size", {})
    return {
        "enable": configs.get("enable", False),
        "strategy": strategy,
        "train_cutoff": cutoff.get("train", 512),
        "test_cutoff": cutoff.get("test", 16384),
        "train_lowerb": lower.get("train", 1),
        "test_lowerb": lower.get("test", 1),
    }


def _batch_like(s_inputs: torch.Tensor, msa: torch.Tensor) -> torch.Tensor:
    """``s_inputs`` [*, N, c] with batch dims that broadcast onto ``msa``'s [*, S, N]: leading
    size-1 dims ``msa`` lacks are dropped, as Protenix's broadcasting add takes them; other
    batch dims that do not broadcast are a ``ValueError``."""
    given, batch, own = tuple(s_inputs.shape), msa.shape[:-2], s_inputs.shape[:-2]
    extra = len(own) - len(batch)
    if extra > 0 and all(n == 1 for n in own[:extra]):
        s_inputs, own, extra = s_inputs.reshape(s_inputs.shape[extra:]), own[extra:], 0
    if extra > 0 or broadcast(batch, own) != batch:
        raise ValueError(
            f"s_inputs {given} does not broadcast onto the MSA features "
            f"{tuple(msa.shape)}: give both the same batch dims"
        )
    return s_inputs


class MSAModule(nn.Module):
    """AF3's MSA module (algorithm 8), Protenix's constructor, names and ``forward``.

    Samples MSA rows as Protenix does (a uniformly drawn count between the lower bound and all
    rows, then a random permutation or the first rows, cut at the cutoff: the same random draws,
    so the same rows for the same seed), embeds them, runs ``n_blocks`` :class:`MSABlock` and
    returns the updated pair tensor. The embedding gathers the rows of ``linear_no_bias_m``'s
    weight for each MSA class instead of multiplying a one-hot tensor, so the [*, S, N, 32]
    one-hot never exists. Recompute while training: the plan's ``recompute`` when a plan is set,
    else "block" per ``blocks_per_ckpt`` as Protenix. With in-place inference asked for
    (``inplace_safe`` or ``plan.inplace``) and no gradient needed, the caller's ``z`` is
    overwritten, as by the Pairformer blocks, unless the MSA's batch dims broadcast it to a
    larger shape (then the result is a new tensor).
    """

    plan: MemoryPlan | None = None

    def __init__(
        self,
        n_blocks: int = 4,
        c_m: int = 64,
        c_z: int = 128,
        c_s_inputs: int = 449,
        msa_dropout: float = 0.15,
        pair_dropout: float = 0.25,
        blocks_per_ckpt: int | None = 1,
        msa_chunk_size: int | None = 2048,
        msa_max_size: int | None = 16384,
        msa_configs: Mapping[str, Any] | None = None,
        hidden_scale_up: bool = False,
    ) -> None:
        super().__init__()
        check_blocks(n_blocks)
        check_blocks_per_ckpt(blocks_per_ckpt)
        check_dropout(msa_dropout, "msa_dropout")
        check_dropout(pair_dropout, "pair_dropout")
        self.n_blocks = n_blocks
        self.c_m = c_m
        self.c_z = c_z
        self.c_s_inputs = c_s_inputs
        self.blocks_per_ckpt = blocks_per_ckpt
        self.msa_chunk_size = check_chunk_size(msa_chunk_size, "msa_chunk_size")
        self.msa_configs = sampling_configs(msa_configs)
        if msa_configs is not None and "sample_cutoff" in msa_configs:
            msa_max_size = self.msa_configs["train_cutoff"]
        self.msa_max_size = msa_max_size
        self.input_feature = dict(_MSA_FEATURES)
        self.linear_no_bias_m = Linear(sum(_MSA_FEATURES.values()), c_m, bias=False)
        self.linear_no_bias_s = Linear(c_s_inputs, c_m, bias=False)
        self.blocks = nn.ModuleList(
            MSABlock(
                c_m=c_m,
                c_z=c_z,
                is_last_block=i + 1 == n_blocks,
                msa_dropout=msa_dropout,
                pair_dropout=pair_dropout,
                msa_chunk_size=msa_chunk_size,
                msa_max_size=self.msa_max_size,
                hidden_scale_up=hidden_scale_up,
            )
            for i in range(n_blocks)
        )

    def sample_msa(self, features: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sampled rows of the MSA features ``msa``, ``has_deletion``, ``deletion_value``
        ([*, S, N] each), drawn as Protenix draws them (training or test settings by mode)."""
        missing = [name for name in _MSA_FEATURES if name not in features]
        if missing:
            raise ValueError(
                f"input_feature_dict lacks the MSA features {missing}; it needs 'msa' (class "
                f"indices), 'has_deletion' and 'deletion_value', each [*, N_msa, N_token]"
            )
        mode = "train" if self.training else "test"
        msa = features["msa"]
        rows = msa.shape[-2]
        lower = min(self.msa_configs[f"{mode}_lowerb"], rows)
        count = int(torch.randint(low=lower, high=rows + 1, size=(1,)).item())
        if self.msa_configs["strategy"] == "random":
            index = torch.randperm(rows, device=msa.device)[:count]
        else:
            index = torch.arange(count, device=msa.device)
        cutoff = self.msa_configs[f"{mode}_cutoff"]
        if cutoff > 0:
            index = index[:cutoff]
        return {name: features[name].index_select(-2, index) for name in _MSA_FEATURES}

    def embed_msa(
        self, features: Mapping[str, torch.Tensor], s_inputs: torch.Tensor
    ) -> torch.Tensor:
        """The MSA embedding [*, S, N, c_m]: ``linear_no_bias_m`` of (one-hot MSA, has_deletion,
        deletion_value) plus ``linear_no_bias_s(s_inputs)``, without building the one-hot."""
        msa = features["msa"]
        if msa.dtype.is_floating_point or msa.dtype == torch.bool:
            raise TypeError(f"input_feature_dict['msa'] must hold class indices, got {msa.dtype}")
        weight = self.linear_no_bias_m.weight  # [c_m, 32 + 1 + 1]
        classes = _MSA_FEATURES["msa"]
        if msa.numel():
            low, high = (int(v) for v in torch.aminmax(msa))
            if low < 0 or high >= classes:
                raise ValueError(
                    f"input_feature_dict['msa'] must hold class indices in [0, {classes}), got "
                    f"values from {low} to {high}"
                )
        m = F.embedding(msa.long(), weight[:, :classes].t())
        for offset, name in enumerate(("has_deletion", "deletion_value")):
            value = features[name].to(weight.dtype).reshape(msa.shape).unsqueeze(-1)
            m = m.addcmul_(value, weight[:, classes + offset])
        return m.add_(self.linear_no_bias_s(s_inputs).unsqueeze(-3))

    def forward(
        self,
        input_feature_dict: Mapping[str, Any],
        z: torch.Tensor,
        s_inputs: torch.Tensor,
        pair_mask: torch.Tensor | None,
        triangle_multiplicative: str = "torch",
        triangle_attention: str = "torch",
        inplace_safe: bool = False,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """The updated pair tensor [*, N, N, c_z]; ``z`` itself when there are no blocks or no
        MSA. ``s_inputs`` [*, N, c_s_inputs]; the kernel-choice strings are ignored."""
        msa = input_feature_dict.get("msa")
        if self.n_blocks < 1 or msa is None or msa.dim() < 2:
            return z
        check_channels("z", z, self.c_z, "a pair tensor [*, N, N, c_z]", 3, self)
        check_channels("s_inputs", s_inputs, self.c_s_inputs, "[*, N, c_s_inputs]", 2, self)
        if not msa.shape[-1] == z.shape[-2] == s_inputs.shape[-2]:
            raise ValueError(
                f"token counts differ: msa {tuple(msa.shape)}, z {tuple(z.shape)}, s_inputs "
                f"{tuple(s_inputs.shape)}; pass the features and embeddings of one complex"
            )
        s_inputs = _batch_like(s_inputs, msa)
        for name in ("has_deletion", "deletion_value"):
            feature = input_feature_dict.get(name)  # a missing one: sample_msa names it
            if isinstance(feature, torch.Tensor) and feature.shape != msa.shape:
                raise ValueError(
                    f"input_feature_dict[{name!r}] must have msa's shape {tuple(msa.shape)} "
                    f"(one value per MSA row and token), got {tuple(feature.shape)}"
                )
        m = self.embed_msa(self.sample_msa(input_feature_dict), s_inputs)
        blocks = [
            functools.partial(
                block, pair_mask=pair_mask, inplace_safe=inplace_safe, chunk_size=chunk_size
            )
            for block in self.blocks
        ]
        _, z = run_blocks(blocks, m, z, *recompute_policy(self), save_ops(self))
        return z
