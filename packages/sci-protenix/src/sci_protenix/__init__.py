"""sci-protenix: Pairformer memory and speed for AlphaFold3-style protein structure models.

    import sci_protenix
    stack = sci_protenix.PairformerStack(n_blocks=4, c_z=128, c_s=384)
    sci_protenix.apply_plan(stack, sci_protenix.plan(tokens=768, budget="8GiB"))
    s, z = stack(s, z, pair_mask)
    sci_protenix.boost(protenix_model)   # Protenix's own modules swapped in place, same weights

The names below are imported on first use, so loading the Spore plugin stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from sci_protenix._version import __version__

_LAZY = {
    "MemoryPlan": "sci_protenix.memory_plan",
    "apply_plan": "sci_protenix.chunking",
    "TriangleMultiplicationOutgoing": "sci_protenix.triangle",
    "TriangleMultiplicationIncoming": "sci_protenix.triangle",
    "TriangleAttention": "sci_protenix.triangle",
    "Transition": "sci_protenix.transition",
    "AttentionPairBias": "sci_protenix.attention",
    "PairformerBlock": "sci_protenix.pairformer",
    "PairformerStack": "sci_protenix.pairformer",
    "OuterProductMean": "sci_protenix.msa",
    "MSAPairWeightedAveraging": "sci_protenix.msa",
    "MSAStack": "sci_protenix.msa",
    "MSABlock": "sci_protenix.msa",
    "MSAModule": "sci_protenix.msa",
    "boost": "sci_protenix.boosting",
    "BoostError": "sci_protenix.boosting",
    "plan": "sci_protenix.planning",
    "parse_budget": "sci_protenix.budget",
    "smooth_lddt_loss": "sci_protenix.lddt",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sci_protenix' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
