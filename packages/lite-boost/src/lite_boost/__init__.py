"""lite-boost: video-diffusion inference acceleration for PyTorch.

    import lite_boost
    lite_boost.boost(transformer, sparsity=0.75)   # diffusers' WanTransformer3DModel, in place
    out = lite_boost.attention(q, k, v)            # the best attention backend for q's device

The names below are imported on first use, so loading the Spore plugin stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from lite_boost._version import __version__

_LAZY = {
    "attention": "lite_boost.backends",
    "use_backend": "lite_boost.backends",
    "sparse_attention": "lite_boost.sparse",
    "block_sparse_attention": "lite_boost.sparse",
    "boost": "lite_boost.boosters",
    "register_booster": "lite_boost.boosters",
    "BoostOptions": "lite_boost.boosters",
    "ParallelManager": "lite_boost.parallel",
    "ulysses_attention": "lite_boost.parallel",
    "decode_temporal_parallel": "lite_boost.parallel",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lite_boost' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
