"""`boost`: the Pairformer and MSA modules of a Protenix model swapped for sci-protenix's.

Each Protenix 2.0.0 module listed in :data:`SWAPPED` found in the model (the outermost one: a
``PairformerStack`` is swapped whole, blocks included) is replaced in its parent by a
sci-protenix module of the same configuration, built on the meta device and given Protenix's
own parameter tensors (``load_state_dict(strict=True, assign=True)`` of the Parameter objects):
no weight is copied, an optimizer made before the swap still holds the model's parameters, and
a parameter name or shape that differs is an error naming the module. Modules of other kinds
(the diffusion module's transitions and local attention, embedders, heads) are left as they are.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from torch import nn

from sci_protenix.chunking import apply_plan
from sci_protenix.memory_plan import MemoryPlan
from sci_protenix.msa import (
    MSABlock,
    MSAModule,
    MSAPairWeightedAveraging,
    MSAStack,
    OuterProductMean,
)
from sci_protenix.pairformer import PairformerBlock, PairformerStack
from sci_protenix.triangle import (
    TriangleAttention,
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    TriangleMultiplicativeUpdate,
)

M = TypeVar("M", bound=nn.Module)
log = logging.getLogger("sci_protenix.boost")  # the logger the README names

_PAIRFORMER = "protenix.model.modules.pairformer"
_TRIANGULAR = "protenix.model.triangular.triangular"
_LAYERS = "protenix.model.triangular.layers"


class BoostError(ValueError):
    """A Protenix module that cannot be swapped (a configuration or shape sci-protenix lacks)."""


class Replacement(NamedTuple):
    """One swap made by :func:`boost`: where, Protenix's class and the sci-protenix class."""

    path: str
    protenix: str
    ours: str


def _pairformer_block(px: nn.Module) -> PairformerBlock:
    if px.c_s > 0:
        apb = px.attention_pair_bias
        if apb.has_s or not apb.create_offset_ln_z or apb.cross_attention_mode:
            raise BoostError(
                "its attention_pair_bias is not the Pairformer's (has_s=False, "
                "create_offset_ln_z=True, no cross attention)"
            )
    ours = PairformerBlock(
        n_heads=px.n_heads,
        c_z=px.tri_mul_out.c_z,
        c_s=px.c_s,
        c_hidden_mul=px.tri_mul_out.c_hidden,
        c_hidden_pair_att=px.tri_att_start.c_hidden,
        no_heads_pair=px.tri_att_start.no_heads,
        num_intermediate_factor=px.pair_transition.n,
        dropout=px.p_drop,
    )
    ours.tri_att_start.inf = px.tri_att_start.inf
    ours.tri_att_end.inf = px.tri_att_end.inf
    return ours


def _pairformer_stack(px: nn.Module) -> PairformerStack:
    first = px.blocks[0] if len(px.blocks) else None
    ours = PairformerStack(
        n_blocks=0,
        n_heads=px.n_heads,
        blocks_per_ckpt=px.blocks_per_ckpt,
        **(
            {}
            if first is None
            else {
                "c_z": first.tri_mul_out.c_z,
                "c_s": first.c_s,
                "num_intermediate_factor": first.pair_transition.n,
                "dropout": first.p_drop,
            }
        ),
    )
    ours.blocks = nn.ModuleList(_pairformer_block(block) for block in px.blocks)
    ours.n_blocks = len(ours.blocks)
    return ours


def _pair_weighted_averaging(px: nn.Module) -> MSAPairWeightedAveraging:
    return MSAPairWeightedAveraging(c_m=px.c_m, c=px.c, c_z=px.c_z, n_heads=px.n_heads)


def _msa_stack(px: nn.Module) -> MSAStack:
    averaging = px.msa_pair_weighted_averaging
    ours = MSAStack(
        c_m=averaging.c_m,
        c_z=averaging.c_z,
        c=px.c,
        dropout=px.p_drop,
        msa_chunk_size=px.msa_chunk_size,
        msa_max_size=px.msa_max_size,
    )
    ours.msa_pair_weighted_averaging = _pair_weighted_averaging(averaging)
    return ours


def _outer_product_mean(px: nn.Module) -> OuterProductMean:
    return OuterProductMean(c_m=px.c_m, c_z=px.c_z, c_hidden=px.c_hidden, eps=px.eps)


def _msa_block(px: nn.Module) -> MSABlock:
    ours = MSABlock(
        c_m=px.c_m,
        c_z=px.c_z,
        c_hidden=px.c_hidden,
        is_last_block=px.is_last_block,
        pair_dropout=px.pair_stack.p_drop,
    )
    ours.outer_product_mean_msa = _outer_product_mean(px.outer_product_mean_msa)
    if not px.is_last_block:
        ours.msa_stack = _msa_stack(px.msa_stack)
    ours.pair_stack = _pairformer_block(px.pair_stack)
    return ours


def _msa_module(px: nn.Module) -> MSAModule:
    ours = MSAModule(
        n_blocks=0,
        c_m=px.c_m,
        c_s_inputs=px.c_s_inputs,
        blocks_per_ckpt=px.blocks_per_ckpt,
        msa_chunk_size=px.msa_chunk_size,
        msa_max_size=px.msa_max_size,
    )
    if dict(px.input_feature) != ours.input_feature:
        raise BoostError(f"its MSA input features {px.input_feature} are not {ours.input_feature}")
    ours.msa_configs.update(px.msa_configs)
    ours.blocks = nn.ModuleList(_msa_block(block) for block in px.blocks)
    ours.n_blocks = len(ours.blocks)
    if len(px.blocks):
        ours.c_z = px.blocks[0].c_z
    return ours


def _triangle_multiplication(px: nn.Module) -> TriangleMultiplicativeUpdate:
    """Ours in ``px``'s direction: Protenix's classes take ``_outgoing`` against their name."""
    ours_cls = TriangleMultiplicationOutgoing if px._outgoing else TriangleMultiplicationIncoming
    return ours_cls(c_z=px.c_z, c_hidden=px.c_hidden)


def _triangle_attention(px: nn.Module) -> TriangleAttention:
    return TriangleAttention(px.c_in, px.c_hidden, px.no_heads, starting=px.starting, inf=px.inf)


SWAPPED: dict[tuple[str, str], Callable[[nn.Module], nn.Module]] = {
    (_PAIRFORMER, "MSAModule"): _msa_module,
    (_PAIRFORMER, "PairformerStack"): _pairformer_stack,
    (_PAIRFORMER, "MSABlock"): _msa_block,
    (_PAIRFORMER, "PairformerBlock"): _pairformer_block,
    (_PAIRFORMER, "MSAStack"): _msa_stack,
    (_PAIRFORMER, "MSAPairWeightedAveraging"): _pair_weighted_averaging,
    (_LAYERS, "OuterProductMean"): _outer_product_mean,
    (_TRIANGULAR, "TriangleMultiplicationOutgoing"): _triangle_multiplication,
    (_TRIANGULAR, "TriangleMultiplicationIncoming"): _triangle_multiplication,
    (_TRIANGULAR, "TriangleAttention"): _triangle_attention,
    (_TRIANGULAR, "TriangleAttentionEndingNode"): _triangle_attention,
}
"""Protenix classes (module, name) swapped by :func:`boost`, each with its converter."""


def _name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _swap(px: nn.Module, path: str) -> nn.Module:
    """Ours for Protenix's ``px``, holding ``px``'s own parameter tensors, in ``px``'s mode."""
    convert = SWAPPED[(type(px).__module__, type(px).__name__)]
    where = f"{path or 'the model'} ({type(px).__name__})"
    try:
        with torch.device("meta"):
            ours = convert(px)
    except (AttributeError, BoostError, ValueError) as error:
        raise BoostError(
            f"cannot swap {where}: {error}; sci_protenix.boost supports Protenix 2.0.0's modules"
        ) from error
    trainable = {name: p.requires_grad for name, p in px.named_parameters()}
    try:
        ours.load_state_dict(px.state_dict(keep_vars=True), strict=True, assign=True)
    except RuntimeError as error:
        raise BoostError(
            f"cannot swap {where}: its parameters do not fit {type(ours).__name__} ({error}); "
            f"sci_protenix.boost supports Protenix 2.0.0's modules"
        ) from None
    finally:  # the assigning load sets requires_grad on Protenix's own Parameter objects
        for name, param in px.named_parameters():
            param.requires_grad_(trainable[name])
    left = [name for name, t in (*ours.named_parameters(), *ours.named_buffers()) if t.is_meta]
    if left:
        raise BoostError(f"cannot swap {where}: no Protenix tensor for {left}")
    return _same_modes(ours, px)


def _same_modes(ours: nn.Module, px: nn.Module) -> nn.Module:
    """``ours`` with each submodule in the train/eval mode of Protenix's of that name (one
    Protenix lacks: its parent's)."""
    theirs = {name: m.training for name, m in px.named_modules()}
    modes: dict[str, bool] = {}
    for name, module in ours.named_modules():  # parents before their children
        mode = theirs.get(name, modes.get(name.rpartition(".")[0], px.training))
        module.training = modes[name] = mode
    return ours


def _targets(parent: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str]]:
    """(parent, attribute, path) of each outermost swappable Protenix module below ``parent``."""
    found = []
    for name, child in parent.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if (type(child).__module__, type(child).__name__) in SWAPPED:
            found.append((parent, name, path))
        elif not type(child).__module__.startswith("sci_protenix."):
            found.extend(_targets(child, path))
    return found


def boost(model: M, plan: MemoryPlan | None = None) -> M:
    """Swap ``model``'s Protenix Pairformer/MSA modules for sci-protenix's, in place; returns it.

    The swapped modules hold the model's own parameters (same tensors) and compute the same
    outputs; ``plan`` (a :class:`~sci_protenix.memory_plan.MemoryPlan`) is then applied to every
    sci-protenix module (:func:`~sci_protenix.chunking.apply_plan`). The swaps made are listed
    in ``model.boost_report`` (a tuple of :class:`Replacement`) and logged. When ``model`` is
    itself one of the swapped classes, the sci-protenix module that replaces it is returned.
    Boosting a boosted model changes nothing but the plan.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"boost needs a torch.nn.Module (a Protenix model), got {type(model)}")
    if importlib.util.find_spec("protenix") is None:
        raise ImportError(
            "sci_protenix.boost swaps the modules of a Protenix model, but protenix is not "
            "installed: pip install protenix==2.0.0 --no-deps, plus rdkit optree ml-collections "
            "scipy (on CPU, import it with LAYERNORM_TYPE=torch)"
        )
    report: list[Replacement] = []
    if (type(model).__module__, type(model).__name__) in SWAPPED:
        ours = _swap(model, "")
        report.append(Replacement("", _name(model), _name(ours)))
        model = ours
    else:
        targets = _targets(model, "")
        swaps = [_swap(getattr(parent, name), path) for parent, name, path in targets]
        for (parent, name, path), ours in zip(targets, swaps, strict=True):  # all or nothing
            report.append(Replacement(path, _name(getattr(parent, name)), _name(ours)))
            setattr(parent, name, ours)
    if not report and not any(
        type(m).__module__.startswith("sci_protenix.") for m in model.modules()
    ):
        raise BoostError(
            f"no Protenix Pairformer/MSA module found in {type(model).__name__}; boost takes a "
            f"Protenix model or one of its modules: {sorted(name for _, name in SWAPPED)}"
        )
    apply_plan(model, plan)
    model.boost_report = (*getattr(model, "boost_report", ()), *report)
    log.info(
        "sci_protenix.boost: %d module(s) swapped: %s",
        len(report),
        ", ".join(f"{r.path or '<root>'} -> {r.ours.rsplit('.', 1)[-1]}" for r in report),
    )
    return model
