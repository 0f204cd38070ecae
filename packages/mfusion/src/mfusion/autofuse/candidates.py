"""Candidate nodes: the ``call_function`` nodes a region compiler may take into a region."""

from __future__ import annotations

import logging
from typing import Any

import torch

from mfusion.autofuse.protocol import RegionCompiler
from mfusion.passes._match import rounds_as_eager
from spore.side_effects import has_side_effect

REGION_NAMESPACE = "mfusion_regions"

log = logging.getLogger("mfusion.autofuse")


def static_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor with concrete (non-symbolic) sizes and strides."""
    if not isinstance(value, torch.Tensor):
        return False
    return all(isinstance(s, int) for s in (*value.shape, *value.stride()))


def is_barrier(node: torch.fx.Node) -> bool:
    """Whether ``node`` may have side effects (a mutation, say; a random op does not count):
    no region spans it or moves past it (:func:`spore.side_effects.has_side_effect`)."""
    return has_side_effect(node, random=False)


def _eligible(node: torch.fx.Node) -> bool:
    """Pure aten-level op returning a new static tensor from at least one; not one of ours; not
    a 16-bit result while Inductor rounds those as eager does (``emulate_precision_casts``:
    a region computes in float32 between its loads and stores, as the hand-written passes'
    ops, which leave such forms alone too)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    if target.namespace == REGION_NAMESPACE or schema.is_mutable:
        return False
    if any(r.alias_info is not None for r in schema.returns):  # a view: the op would copy it
        return False
    if torch.Tag.nondeterministic_seeded in target.tags or node.is_impure():
        return False
    inputs = node.all_input_nodes
    value = node.meta.get("val")
    if not inputs or not static_tensor(value) or rounds_as_eager(value):
        return False
    return all(static_tensor(i.meta.get("val")) for i in inputs)


def _supports(compiler: RegionCompiler, node: torch.fx.Node, failed: set[Any]) -> bool:
    try:
        return bool(compiler.supports(node))
    except Exception as exc:
        if node.target not in failed:
            failed.add(node.target)
            log.warning(
                "region compiler %r: supports(%s) raised %s: %s; treated as unsupported",
                compiler.name,
                node.target,
                type(exc).__name__,
                exc,
            )
        return False


def candidate_nodes(graph: torch.fx.Graph, compiler: RegionCompiler) -> set[torch.fx.Node]:
    """The nodes of ``graph`` that are safe to outline and that ``compiler`` supports.

    Safe: an ``OpOverload`` that mutates nothing, returns no view, is not random
    (``nondeterministic_seeded``) or impure, reads at least one tensor, and whose inputs and
    output are tensors of static shape (the output not 16-bit while Inductor emulates eager's
    roundings). A ``supports`` that raises counts as ``False`` (logged once per op).
    """
    failed: set[Any] = set()
    return {n for n in graph.nodes if _eligible(n) and _supports(compiler, n, failed)}
